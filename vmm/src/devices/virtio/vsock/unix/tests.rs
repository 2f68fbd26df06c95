//! The host side's tests: credit, the bounded control queue, connection caps, a full
//! backlog, and the timeout of pending host connections.

use std::os::fd::AsRawFd;
use std::sync::mpsc::channel;

use super::*;

const GUEST_CID: u64 = 3;

fn muxer(dir: &Path) -> UnixMuxer {
    UnixMuxer::new(GUEST_CID, &dir.join("v.sock")).expect("muxer")
}

/// A packet from guest port `src` to host port `dst`.
fn from_guest(src: u32, dst: u32, op: u16) -> PacketHeader {
    PacketHeader {
        src_cid: GUEST_CID,
        dst_cid: HOST_CID,
        src_port: src,
        dst_port: dst,
        type_: TYPE_STREAM,
        op,
        buf_alloc: BUF_ALLOC,
        ..Default::default()
    }
}

fn ops(m: &UnixMuxer) -> Vec<u16> {
    m.control.iter().map(|h| h.op).collect()
}

#[test]
fn forwarded_bytes_are_counted_and_credit_updates_come_every_quarter_buffer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut m = muxer(dir.path());
    let (ours, mut theirs) = UnixStream::pair().expect("pair");
    let key = (5000, 1000);
    m.add_conn(key, ours, ConnState::Established).expect("add");
    let chunk = vec![7u8; (BUF_ALLOC / 8) as usize];
    let mut rw = from_guest(1000, 5000, op::RW);
    m.handle_guest_packet(&rw, &chunk);
    assert!(ops(&m).is_empty(), "an eighth of the buffer: no update yet");
    m.handle_guest_packet(&rw, &chunk);
    assert_eq!(ops(&m), [op::CREDIT_UPDATE]);
    m.handle_guest_packet(&rw, &chunk);
    m.handle_guest_packet(&rw, &chunk);
    assert_eq!(ops(&m), [op::CREDIT_UPDATE], "one queued update is enough");
    let (h, _) = m.next_rx(4096).expect("update");
    assert_eq!(h.fwd_cnt, BUF_ALLOC / 2, "bytes written to the host");
    let mut got = vec![0u8; (BUF_ALLOC / 2) as usize];
    theirs.read_exact(&mut got).expect("host reads");
    // More than the advertised buffer unread on the host: the guest overran its credit.
    theirs.set_nonblocking(true).expect("nonblocking host end");
    rw.len = 0;
    let big = vec![0u8; BUF_ALLOC as usize];
    for _ in 0..8 {
        m.handle_guest_packet(&rw, &big);
    }
    assert!(!m.conns.contains_key(&key), "overrun resets the connection");
    assert_eq!(m.control.back().map(|h| h.op), Some(op::RST));
}

#[test]
fn control_queue_is_bounded_when_the_guest_gives_no_rx_buffers() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut m = muxer(dir.path());
    for port in 0..(MAX_CONTROL as u32 + 1000) {
        // Data for connections that do not exist: each would be answered with RST.
        m.handle_guest_packet(&from_guest(port, 9, op::RW), &[]);
    }
    assert_eq!(m.control.len(), MAX_CONTROL);
    assert_eq!(m.dropped_control(), 1000);
    // A guest asking again and again for credit on a live connection gets one update.
    let dir = tempfile::tempdir().expect("tempdir");
    let mut m = muxer(dir.path());
    let (ours, _theirs) = UnixStream::pair().expect("pair");
    m.add_conn((5000, 1000), ours, ConnState::Established)
        .expect("add");
    for _ in 0..1000 {
        m.handle_guest_packet(&from_guest(1000, 5000, op::CREDIT_REQUEST), &[]);
    }
    assert_eq!(ops(&m), [op::CREDIT_UPDATE]);
}

#[test]
fn a_connections_control_packets_wait_for_room_and_go_before_its_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut m = muxer(dir.path());
    let listener = UnixListener::bind(dir.path().join("v.sock_5000")).expect("listen");
    for port in 0..MAX_CONTROL as u32 {
        m.handle_guest_packet(&from_guest(port, 9, op::RW), &[]);
    }
    m.handle_guest_packet(&from_guest(1000, 5000, op::REQUEST), &[]);
    assert_eq!(m.conns.len(), 1, "the connection is kept");
    assert_eq!(m.dropped_control(), 0);
    let (mut host, _) = listener.accept().expect("the host saw the connect");
    host.write_all(b"early data").expect("host writes");
    // Credit from the guest, asked for again and again: one update waits, coalesced.
    for _ in 0..10 {
        m.handle_guest_packet(&from_guest(1000, 5000, op::CREDIT_REQUEST), &[]);
    }
    assert_eq!(m.control.len(), MAX_CONTROL);
    let mut sent = Vec::new();
    while let Some((h, payload)) = m.next_rx(4096) {
        sent.push((h.op, payload.len()));
    }
    let ours: Vec<(u16, usize)> = sent[MAX_CONTROL..].to_vec();
    assert_eq!(
        ours,
        [(op::RESPONSE, 0), (op::CREDIT_UPDATE, 0), (op::RW, 10)],
        "RESPONSE before the host's data"
    );
    // A reset for an unknown connection finds no room and is dropped, counted.
    for port in 0..=MAX_CONTROL as u32 {
        m.handle_guest_packet(&from_guest(port, 9, op::RW), &[]);
    }
    assert_eq!(m.dropped_control(), 1);
}

#[test]
fn guest_connection_flood_is_capped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut m = muxer(dir.path());
    m.max_conns = 4;
    let listener = UnixListener::bind(dir.path().join("v.sock_5000")).expect("listen");
    for port in 0..10 {
        m.handle_guest_packet(&from_guest(1000 + port, 5000, op::REQUEST), &[]);
    }
    assert_eq!(m.conns.len(), 4);
    assert_eq!(m.refused_conns(), 6);
    let responses = ops(&m).iter().filter(|&&o| o == op::RESPONSE).count();
    let resets = ops(&m).iter().filter(|&&o| o == op::RST).count();
    assert_eq!((responses, resets), (4, 6));
    // Host-initiated connections count too: one more is refused at once.
    let mut host = UnixStream::connect(dir.path().join("v.sock")).expect("connect");
    m.accept_all();
    let mut reply = String::new();
    host.read_to_string(&mut reply).expect("read");
    assert_eq!(reply, "ERR too many connections\n");
    assert!(m.pending.is_empty());
    drop(listener);
}

#[test]
fn a_host_listener_with_a_full_backlog_is_refused_without_blocking() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("v.sock_5000");
    let listener = UnixListener::bind(&path).expect("listen");
    // SAFETY: listen(2) on a socket we own; a second call only shrinks the backlog.
    assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
    let mut queued = Vec::new();
    loop {
        match connect_nonblocking(&path) {
            Ok(s) => queued.push(s),
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => panic!("filling the backlog: {e}"),
        }
        assert!(queued.len() < 4096, "the backlog never filled");
    }
    let mut m = muxer(dir.path());
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        m.handle_guest_packet(&from_guest(1000, 5000, op::REQUEST), &[]);
        let _ = tx.send(ops(&m));
    });
    let answered = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the guest's connect blocked the event loop");
    assert_eq!(answered, [op::RST]);
    drop(listener);
}

/// Waits (at most 5 s) for the muxer's epoll fd to be readable, as the VMM's loop does.
fn wait_for_event(m: &UnixMuxer) {
    let mut fds = [libc::pollfd {
        fd: m.epoll_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    // SAFETY: one valid pollfd that outlives the call.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, 5000) };
    assert_eq!(n, 1, "no event within 5 s");
}

#[test]
fn host_connections_that_stay_pending_are_closed_after_the_timeout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut m = muxer(dir.path());
    assert_eq!(m.pending_timeout, Duration::from_secs(2), "Firecracker's");
    m.pending_timeout = Duration::from_millis(100);
    // One never sends its CONNECT line; one sends it to a guest port that never answers.
    let mut silent = UnixStream::connect(dir.path().join("v.sock")).expect("connect");
    let mut unanswered = UnixStream::connect(dir.path().join("v.sock")).expect("connect");
    unanswered.write_all(b"CONNECT 52\n").expect("write");
    m.process_events();
    m.process_events();
    assert_eq!(m.pending.len(), 1, "the silent one waits for its line");
    assert_eq!(m.conns.len(), 1, "the other waits for the guest");
    assert_eq!(ops(&m), [op::REQUEST]);
    m.control.clear();
    // Nothing happens on either socket: the timer alone wakes the VMM's loop.
    let started = Instant::now();
    while !(m.pending.is_empty() && m.conns.is_empty()) {
        wait_for_event(&m);
        m.process_events();
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }
    assert!(started.elapsed() >= Duration::from_millis(90));
    assert!(m.pending.is_empty(), "no CONNECT line: closed");
    assert!(m.conns.is_empty(), "no answer from the guest: closed");
    assert_eq!(
        ops(&m),
        [op::RST],
        "the guest hears of the one it was asked for"
    );
    assert_eq!(m.timed_out_conns(), 2);
    for host in [&mut silent, &mut unanswered] {
        host.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let mut rest = Vec::new();
        host.read_to_end(&mut rest)
            .expect("the host sees the close");
        assert!(rest.is_empty(), "{rest:?}");
    }
    // A guest that answers in time keeps its connection, and the timer is off again.
    m.control.clear();
    let mut answered = UnixStream::connect(dir.path().join("v.sock")).expect("connect");
    answered.write_all(b"CONNECT 53\n").expect("write");
    m.process_events();
    m.process_events();
    let (h, _) = m.next_rx(4096).expect("request");
    assert_eq!(h.op, op::REQUEST);
    m.handle_guest_packet(&from_guest(53, h.src_port, op::RESPONSE), &[]);
    std::thread::sleep(Duration::from_millis(150));
    m.process_events();
    assert_eq!(m.conns.len(), 1, "an established connection has no timeout");
    assert_eq!(m.timer_at, None);
    let mut ok = [0u8; 3];
    answered.read_exact(&mut ok).expect("OK");
    assert_eq!(&ok, b"OK ");
}
