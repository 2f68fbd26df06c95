//! One connection: read frames, start requests, route stream input to open
//! requests by id, and write every reply through one writer task.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use rollbox_agent_protocol::frame::{self, FrameError};
use rollbox_agent_protocol::{
    ClientFrame, ClientMessage, ErrorInfo, ServerFrame, ServerMessage, PROTOCOL_VERSION,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;

use crate::agent::Agent;
use crate::errors::internal;
use crate::exec::{self, ExecInput, Sink};
use crate::files::{self, ChunkSender, UploadInput};
use crate::{docker, fixups, health, tcp, watch};

/// Input side of an open request.
enum StreamInput {
    Exec(mpsc::UnboundedSender<ExecInput>),
    Upload(mpsc::Sender<UploadInput>),
    Download(Arc<AtomicBool>),
    /// A `watch`: a unit is the client's `cancel`; dropping the sender ends it too.
    Watch(mpsc::UnboundedSender<()>),
}

#[derive(Clone, Default)]
struct Streams(Arc<Mutex<HashMap<u64, StreamInput>>>);

impl Streams {
    fn lock(&self) -> MutexGuard<'_, HashMap<u64, StreamInput>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn remove(&self, id: u64) {
        self.lock().remove(&id);
    }
}

/// Frames queued for the writer; bounded so slow clients slow producers down.
const OUT_QUEUE: usize = 256;
/// Most output (stdout + stderr) a `run` returns; base64 makes it 4/3 larger
/// in the frame. Larger outputs need `exec`, which streams.
pub const RUN_OUTPUT_MAX: u64 = 8 << 20;
/// Upload chunks buffered per request before the reader waits for the disk.
const UPLOAD_QUEUE: usize = 16;

pub async fn serve<S>(agent: Arc<Agent>, stream: S)
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (mut reader, mut writer) = tokio::io::split(stream);
    let (out, mut out_rx) = mpsc::channel::<ServerFrame>(OUT_QUEUE);
    // Hands the writer back once every sender is gone, for `tcp_connect`'s pipe.
    let writer_task = tokio::spawn(async move {
        while let Some(frame) = out_rx.recv().await {
            let id = frame.id;
            let result = match frame::write_frame(&mut writer, &frame).await {
                // Nothing was written: the connection is intact, so answer with an error instead.
                Err(err @ (FrameError::TooLarge { .. } | FrameError::Encode(_))) => {
                    let body = ServerMessage::Error(internal(format!(
                        "reply to request {id} not sent: {err}"
                    )));
                    frame::write_frame(&mut writer, &ServerFrame { id, body }).await
                }
                other => other,
            };
            if let Err(err) = result {
                log::info!("connection write failed: {err}");
                break;
            }
        }
        writer
    });
    let streams = Streams::default();
    let mut first = true;
    // Whether a request other than `hello` came: then `tcp_connect` is refused, as the
    // connection has answers still to carry.
    let mut busy = false;
    loop {
        let body = match frame::read_frame_body(&mut reader).await {
            Ok(Some(body)) => body,
            Ok(None) => break,
            Err(err) => {
                log::info!("connection read failed: {err}");
                break;
            }
        };
        if first {
            // After a restore every connection is new: check for a clone first.
            first = false;
            check_generation(&agent).await;
        }
        match frame::decode::<ClientFrame>(&body) {
            Ok(ClientFrame {
                id,
                body: ClientMessage::TcpConnect { host, port },
            }) => {
                let refusal = if busy {
                    Some(ErrorInfo::bad_request(format!(
                        "tcp_connect {host}:{port}: only hello may come before tcp_connect on a connection (it becomes a byte pipe); open a new connection"
                    )))
                } else {
                    // A refused connect leaves the connection as it was: a retry may follow.
                    match tcp::connect(&host, port).await {
                        Ok(socket) => {
                            let address = socket
                                .peer_addr()
                                .map_or_else(|_| format!("{host}:{port}"), |a| a.to_string());
                            reply(&out, id, ServerMessage::TcpConnected { address }).await;
                            // The writer task ends once it wrote every queued frame.
                            drop(out);
                            match writer_task.await {
                                Ok(writer) => {
                                    let mut connection = reader.unsplit(writer);
                                    tcp::pipe(&mut connection, socket).await;
                                }
                                Err(err) => log::warn!("connection writer task failed: {err}"),
                            }
                            return;
                        }
                        Err(info) => Some(info),
                    }
                };
                if let Some(info) = refusal {
                    reply(&out, id, ServerMessage::Error(info)).await;
                }
            }
            Ok(frame) => {
                busy |= frame.body != ClientMessage::Hello;
                dispatch(&agent, frame, &out, &streams).await
            }
            Err(err) => {
                // Answer under the frame's id when it has one, so the client can match it.
                let id = serde_json::from_slice::<serde_json::Value>(&body)
                    .ok()
                    .and_then(|v| v.get("id")?.as_u64())
                    .unwrap_or(0);
                let message = format!("invalid request frame: {err}");
                reply(
                    &out,
                    id,
                    ServerMessage::Error(ErrorInfo::bad_request(message)),
                )
                .await;
            }
        }
    }
    // The client is gone: dropping the inputs kills its processes and aborts its uploads.
    streams.lock().clear();
}

/// Re-identifies the guest if the VM generation changed (see generation.rs).
async fn check_generation(agent: &Arc<Agent>) {
    if agent.generation.is_none() {
        return;
    }
    let agent = Arc::clone(agent);
    // It may write files and fsync: keep it off the async workers.
    let _ = tokio::task::spawn_blocking(move || {
        if let Some(watcher) = &agent.generation {
            watcher.check();
        }
    })
    .await;
}

async fn reply(out: &mpsc::Sender<ServerFrame>, id: u64, body: ServerMessage) {
    // A closed queue means the connection is gone; nobody is left to tell.
    let _ = out.send(ServerFrame { id, body }).await;
}

fn reply_blocking(out: &mpsc::Sender<ServerFrame>, id: u64, body: ServerMessage) {
    let _ = out.blocking_send(ServerFrame { id, body });
}

fn no_stream(id: u64, what: &str) -> ServerMessage {
    ServerMessage::Error(ErrorInfo {
        code: "unknown_request".into(),
        errno: None,
        message: format!("{what}: no open request with id {id} takes this input"),
    })
}

async fn dispatch(
    agent: &Arc<Agent>,
    frame: ClientFrame,
    out: &mpsc::Sender<ServerFrame>,
    streams: &Streams,
) {
    let ClientFrame { id, body } = frame;
    let (exec_input, upload_input) = match body {
        ClientMessage::Stdin { data } => (Some(ExecInput::Stdin(data)), None),
        ClientMessage::StdinClose => (Some(ExecInput::StdinClose), None),
        ClientMessage::Signal { signal, group } => {
            (Some(ExecInput::Signal { signal, group }), None)
        }
        ClientMessage::Resize(size) => (Some(ExecInput::Resize(size)), None),
        ClientMessage::Data { data } => (None, Some(UploadInput::Data(data))),
        ClientMessage::End => (None, Some(UploadInput::End)),
        ClientMessage::Cancel => return cancel(id, out, streams).await,
        other => return start_new(agent, id, other, out, streams).await,
    };
    if let Some(input) = exec_input {
        let delivered = match streams.lock().get(&id) {
            Some(StreamInput::Exec(tx)) => tx.send(input).is_ok(),
            _ => false,
        };
        if !delivered {
            reply(out, id, no_stream(id, "stdin/signal/resize")).await;
        }
    }
    if let Some(input) = upload_input {
        let tx = match streams.lock().get(&id) {
            Some(StreamInput::Upload(tx)) => Some(tx.clone()),
            _ => None,
        };
        match tx {
            Some(tx) if tx.send(input).await.is_ok() => {}
            // A failed upload already answered with its error; later chunks are dropped.
            Some(_) => {}
            None => reply(out, id, no_stream(id, "upload data")).await,
        }
    }
}

async fn cancel(id: u64, out: &mpsc::Sender<ServerFrame>, streams: &Streams) {
    let upload = {
        let map = streams.lock();
        match map.get(&id) {
            Some(StreamInput::Exec(tx)) => {
                let _ = tx.send(ExecInput::Cancel);
                return;
            }
            Some(StreamInput::Download(flag)) => {
                flag.store(true, Ordering::Relaxed);
                return;
            }
            Some(StreamInput::Watch(stop)) => {
                let _ = stop.send(());
                return;
            }
            Some(StreamInput::Upload(tx)) => Some(tx.clone()),
            None => None,
        }
    };
    match upload {
        Some(tx) => {
            let _ = tx.send(UploadInput::Cancel).await;
        }
        None => reply(out, id, no_stream(id, "cancel")).await,
    }
}

async fn start_new(
    agent: &Arc<Agent>,
    id: u64,
    body: ClientMessage,
    out: &mpsc::Sender<ServerFrame>,
    streams: &Streams,
) {
    if streams.lock().contains_key(&id) {
        let message = format!("request id {id} is already in use by an open request");
        reply(
            out,
            id,
            ServerMessage::Error(ErrorInfo::bad_request(message)),
        )
        .await;
        return;
    }
    start(Arc::clone(agent), id, body, out.clone(), streams.clone()).await;
}

/// Run a short blocking operation and send its single reply.
fn blocking<F>(out: mpsc::Sender<ServerFrame>, id: u64, work: F)
where
    F: FnOnce() -> Result<ServerMessage, ErrorInfo> + Send + 'static,
{
    tokio::task::spawn_blocking(move || {
        let body = work().unwrap_or_else(ServerMessage::Error);
        reply_blocking(&out, id, body);
    });
}

/// Runs an upload (file write, tar upload) on a blocking thread: its input stream is
/// registered, `Ready` goes out once the destination is prepared, and the answer is `Written`
/// or the error.
fn upload<F>(streams: Streams, out: mpsc::Sender<ServerFrame>, id: u64, work: F)
where
    F: FnOnce(&mut mpsc::Receiver<UploadInput>, &dyn Fn() -> bool) -> Result<u64, ErrorInfo>
        + Send
        + 'static,
{
    let mut rx = open_upload(&streams, id);
    tokio::task::spawn_blocking(move || {
        let ready = || {
            out.blocking_send(ServerFrame {
                id,
                body: ServerMessage::Ready,
            })
            .is_ok()
        };
        let result = work(&mut rx, &ready);
        streams.remove(id);
        reply_blocking(
            &out,
            id,
            result
                .map(|bytes| ServerMessage::Written { bytes })
                .unwrap_or_else(ServerMessage::Error),
        );
    });
}

async fn start(
    agent: Arc<Agent>,
    id: u64,
    body: ClientMessage,
    out: mpsc::Sender<ServerFrame>,
    streams: Streams,
) {
    match body {
        ClientMessage::Hello => {
            let body = ServerMessage::Hello {
                agent_version: env!("CARGO_PKG_VERSION").to_owned(),
                protocol_version: PROTOCOL_VERSION,
            };
            reply(&out, id, body).await;
        }
        ClientMessage::Health => blocking(out, id, move || {
            health::health(&agent).map(ServerMessage::Health)
        }),
        ClientMessage::Stat {
            path,
            follow_symlinks,
        } => blocking(out, id, move || {
            files::stat(&path, follow_symlinks).map(ServerMessage::Stat)
        }),
        ClientMessage::LookupUser { name } => blocking(out, id, move || {
            crate::users::account(&agent.config.etc_dir, &name).map(ServerMessage::Account)
        }),
        ClientMessage::List { path } => blocking(out, id, move || {
            files::list(&path).map(|entries| ServerMessage::List { entries })
        }),
        ClientMessage::Mkdir {
            path,
            parents,
            mode,
            owner,
        } => {
            let etc = agent.config.etc_dir.clone();
            blocking(out, id, move || {
                let owner = match owner.as_deref() {
                    Some(name) => Some(crate::users::owner(&etc, name, &path)?),
                    None => None,
                };
                files::mkdir(&path, parents, mode, owner).map(|()| ServerMessage::Ok)
            })
        }
        ClientMessage::Remove { path, recursive } => blocking(out, id, move || {
            files::remove(&path, recursive).map(|()| ServerMessage::Ok)
        }),
        ClientMessage::Move { from, to } => blocking(out, id, move || {
            files::rename(&from, &to).map(|()| ServerMessage::Ok)
        }),
        ClientMessage::SetTime {
            unix_seconds,
            nanos,
        } => blocking(out, id, move || {
            fixups::set_time(agent.config.set_clock, unix_seconds, nanos)
        }),
        ClientMessage::Reseed { seed } => blocking(out, id, move || fixups::reseed(&seed)),
        ClientMessage::PowerOff { reboot } => blocking(out, id, move || {
            fixups::power_off(agent.config.is_init, reboot)
        }),
        ClientMessage::ConfigureNetwork(request) => blocking(out, id, move || {
            // An agent that is not the guest's init (`--no-init`: a host test's stand-in)
            // would re-address the host's interfaces.
            if !agent.config.is_init {
                return Err(ErrorInfo::bad_request(
                    "configure_network: refused: this agent runs with --no-init (not as a guest's init), so the interfaces are not a guest's",
                ));
            }
            let (config, mac) = crate::network::from_request(&request)
                .map_err(|e| ErrorInfo::bad_request(format!("configure_network: {e}")))?;
            crate::network::reconfigure(&config, mac, &agent.config.etc_dir)
                .map_err(|e| ErrorInfo::bad_request(format!("configure_network: {e}")))?;
            Ok(ServerMessage::Applied {
                applied: true,
                detail: format!("{} is {}", config.device, request.address),
            })
        }),
        ClientMessage::SetIdentity {
            hostname,
            machine_id,
        } => blocking(out, id, move || {
            fixups::set_identity(
                &agent.config.machine_id_path,
                hostname.as_deref(),
                machine_id.as_deref(),
            )
        }),
        ClientMessage::Exec(req) => {
            let inputs = open_exec(&streams, id);
            tokio::spawn(async move {
                let mut sink = Sink::Stream {
                    id,
                    out: out.clone(),
                    seq: 0,
                };
                let result = exec::run(&agent, req, &mut sink, inputs, None).await;
                streams.remove(id);
                reply(
                    &out,
                    id,
                    result
                        .map(ServerMessage::Exited)
                        .unwrap_or_else(ServerMessage::Error),
                )
                .await;
            });
        }
        ClientMessage::Run(mut req) => {
            // The whole output travels in one frame: keep it well under the frame limit.
            req.output_limit_bytes = Some(
                req.output_limit_bytes
                    .map_or(RUN_OUTPUT_MAX, |l| l.min(RUN_OUTPUT_MAX)),
            );
            let inputs = open_exec(&streams, id);
            tokio::spawn(async move {
                let mut sink = Sink::Collect {
                    stdout: Vec::new(),
                    stderr: Vec::new(),
                };
                let result = exec::run(&agent, req, &mut sink, inputs, None).await;
                streams.remove(id);
                let body = match (result, sink) {
                    (Ok(status), Sink::Collect { stdout, stderr }) => ServerMessage::RunResult {
                        stdout,
                        stderr,
                        status,
                    },
                    (Err(err), _) => ServerMessage::Error(err),
                    (Ok(_), Sink::Stream { .. }) => {
                        ServerMessage::Error(internal("run: output sink changed kind"))
                    }
                };
                reply(&out, id, body).await;
            });
        }
        ClientMessage::DockerEnsure {
            timeout_ms,
            extra_args,
        } => {
            tokio::spawn(async move {
                let body = match docker::ensure(
                    &agent,
                    timeout_ms.map(Duration::from_millis),
                    &extra_args,
                )
                .await
                {
                    Ok((started, waited_ms)) => ServerMessage::DockerReady { started, waited_ms },
                    Err(err) => ServerMessage::Error(err),
                };
                reply(&out, id, body).await;
            });
        }
        ClientMessage::DockerRun(req) => {
            let inputs = open_exec(&streams, id);
            tokio::spawn(async move {
                let result = async {
                    if req.ensure_daemon {
                        docker::ensure(&agent, None, &[]).await?;
                    }
                    let (exec_req, cleanup) = docker::run_command(&agent, &req)?;
                    let mut sink = Sink::Stream {
                        id,
                        out: out.clone(),
                        seq: 0,
                    };
                    exec::run(&agent, exec_req, &mut sink, inputs, Some(cleanup)).await
                }
                .await;
                streams.remove(id);
                reply(
                    &out,
                    id,
                    result
                        .map(ServerMessage::Exited)
                        .unwrap_or_else(ServerMessage::Error),
                )
                .await;
            });
        }
        ClientMessage::ReadFile {
            path,
            offset,
            length,
        } => {
            let mut sender = open_download(&streams, id, &out);
            tokio::task::spawn_blocking(move || {
                let result = files::read_file(&path, offset, length, &mut sender);
                streams.remove(id);
                reply_blocking(
                    &out,
                    id,
                    result
                        .map(|bytes| ServerMessage::End { bytes })
                        .unwrap_or_else(ServerMessage::Error),
                );
            });
        }
        ClientMessage::TarDownload { path } => {
            let mut sender = open_download(&streams, id, &out);
            tokio::task::spawn_blocking(move || {
                let result = files::tar_download(&path, &mut sender);
                streams.remove(id);
                reply_blocking(
                    &out,
                    id,
                    result
                        .map(|bytes| ServerMessage::End { bytes })
                        .unwrap_or_else(ServerMessage::Error),
                );
            });
        }
        ClientMessage::WriteFile(req) => {
            let etc = agent.config.etc_dir.clone();
            upload(streams, out, id, move |rx, ready| {
                let owner = match req.owner.as_deref() {
                    Some(name) => Some(crate::users::owner(&etc, name, &req.path)?),
                    None => None,
                };
                files::write_file(&req, owner, rx, ready)
            })
        }
        ClientMessage::TarUpload { path } => upload(streams, out, id, move |rx, ready| {
            files::tar_upload(&path, rx, ready)
        }),
        ClientMessage::Watch(req) => {
            let (stop, stop_rx) = mpsc::unbounded_channel();
            streams.lock().insert(id, StreamInput::Watch(stop));
            tokio::spawn(async move {
                let end = watch::run(req, id, &out, stop_rx).await;
                streams.remove(id);
                reply(&out, id, end).await;
            });
        }
        ClientMessage::TcpConnect { host, port } => {
            // serve() takes tcp_connect before dispatch, as it needs the connection itself.
            let message = format!("tcp_connect {host}:{port} reached the request starter");
            reply(&out, id, ServerMessage::Error(internal(message))).await;
        }
        ClientMessage::Stdin { .. }
        | ClientMessage::Resize(_)
        | ClientMessage::StdinClose
        | ClientMessage::Signal { .. }
        | ClientMessage::Cancel
        | ClientMessage::Data { .. }
        | ClientMessage::End => {
            // dispatch() routes stream input before calling start().
            reply(
                &out,
                id,
                ServerMessage::Error(internal("stream input reached the request starter")),
            )
            .await;
        }
    }
}

fn open_exec(streams: &Streams, id: u64) -> mpsc::UnboundedReceiver<ExecInput> {
    let (tx, rx) = mpsc::unbounded_channel();
    streams.lock().insert(id, StreamInput::Exec(tx));
    rx
}

fn open_upload(streams: &Streams, id: u64) -> mpsc::Receiver<UploadInput> {
    let (tx, rx) = mpsc::channel(UPLOAD_QUEUE);
    streams.lock().insert(id, StreamInput::Upload(tx));
    rx
}

fn open_download(streams: &Streams, id: u64, out: &mpsc::Sender<ServerFrame>) -> ChunkSender {
    let cancel = Arc::new(AtomicBool::new(false));
    streams
        .lock()
        .insert(id, StreamInput::Download(Arc::clone(&cancel)));
    ChunkSender::new(id, out.clone(), cancel)
}
