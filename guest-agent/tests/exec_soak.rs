//! The lost-output soak (issue 29): hundreds of concurrent short execs through the real
//! agent binary in host mode, on cores kept busy, each echoing a token of its own; every
//! answer must be exactly its token with exit 0 (an exec that "exits 0" with empty stdout
//! is the defect this guards against).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::AgentProcess;
use rollbox_agent_protocol::{AgentClient, ExecOutput, ExecRequest};

/// Execs in flight at once.
const CONCURRENCY: usize = 256;
/// Rounds of `CONCURRENCY` execs; the soak stops early once `BUDGET` is spent.
const ROUNDS: usize = 12;
const BUDGET: Duration = Duration::from_secs(45);

/// Threads that spin for the soak's length, so the agent and its children compete for CPU.
struct Burners {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Burners {
    fn start(n: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        for _ in 0..10_000 {
                            x = std::hint::black_box(x.wrapping_mul(6364136223846793005) + 1);
                        }
                    }
                })
            })
            .collect();
        Burners { stop, threads }
    }
}

impl Drop for Burners {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// One exec of `echo <token>` in one of the forms the daemon and the E2B façade use.
async fn one(client: &AgentClient, token: &str, form: usize) -> ExecOutput {
    let request = match form % 4 {
        // The native API's unary exec: `sh -c`, collected by the agent (`run`).
        0 => ExecRequest::shell(format!("echo {token}")),
        // An external echo: the output comes from an exec'd program, not a shell builtin.
        1 => ExecRequest::argv(["/bin/echo", token]),
        // The E2B form: argv through bash, with a stdin pipe held open.
        2 => {
            let mut request =
                ExecRequest::argv(["/bin/bash".to_owned(), "-c".into(), format!("echo {token}")]);
            request.stdin = true;
            request
        }
        _ => ExecRequest::shell(format!("echo {token}")),
    };
    let result = if form.is_multiple_of(2) {
        client.run(request).await
    } else {
        match client.exec(request).await {
            Ok(handle) => handle.collect().await,
            Err(err) => Err(err),
        }
    };
    result.unwrap_or_else(|err| panic!("exec {token} (form {form}): {err}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_output_of_256_concurrent_execs_under_load_arrives() {
    let agent = AgentProcess::start();
    let shared = agent.client().await;
    let _burners = Burners::start(4);
    let started = Instant::now();
    let mut total = 0usize;
    let mut wrong = Vec::new();
    for round in 0..ROUNDS {
        if started.elapsed() > BUDGET {
            break;
        }
        let mut tasks = Vec::with_capacity(CONCURRENCY);
        for i in 0..CONCURRENCY {
            let token = format!("t{round}x{i}");
            // Half on one multiplexed connection, half on a connection each (as the daemon does).
            let own = i % 2 == 1;
            let shared = shared.clone();
            let socket = agent.socket.clone();
            tasks.push(tokio::spawn(async move {
                let client = if own {
                    AgentClient::connect_unix(&socket, rollbox_agent_protocol::DEFAULT_PORT)
                        .await
                        .unwrap_or_else(|err| panic!("connect for {token}: {err}"))
                } else {
                    shared
                };
                let output = one(&client, &token, i / 2).await;
                (token, output)
            }));
        }
        for task in tasks {
            let (token, output) = task.await.expect("join");
            total += 1;
            let stdout = String::from_utf8_lossy(&output.stdout);
            if stdout != format!("{token}\n") || output.status.code != Some(0) {
                wrong.push(format!(
                    "{token}: stdout {stdout:?}, stderr {:?}, status {:?}",
                    String::from_utf8_lossy(&output.stderr),
                    output.status
                ));
            }
        }
    }
    eprintln!(
        "exec soak: {total} execs in {:.1} s, {} wrong",
        started.elapsed().as_secs_f64(),
        wrong.len()
    );
    assert!(
        total >= CONCURRENCY * 2,
        "only {total} execs ran within the budget"
    );
    assert!(
        wrong.is_empty(),
        "{} of {total} execs lost or changed their output:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}
