//! Figures for the agent in host mode over its Unix socket. Prints, never fails on time.
//!   cargo bench -p rollbox-agent

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rollbox_agent_protocol::{AgentClient, ExecRequest, DEFAULT_PORT};

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("agent.sock");
    let mut agent = Command::new(env!("CARGO_BIN_EXE_rollbox-agent"))
        .arg("--listen-unix")
        .arg(&socket)
        .arg("--no-set-clock")
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn agent");
    let start = Instant::now();
    while !socket.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "agent did not start"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let connects: Vec<Duration> = {
            let mut v = Vec::new();
            for _ in 0..50 {
                let t = Instant::now();
                let client = AgentClient::connect_unix(&socket, DEFAULT_PORT)
                    .await
                    .expect("connect");
                client.hello().await.expect("hello");
                v.push(t.elapsed());
            }
            v
        };
        println!(
            "connect + CONNECT preamble + hello: median {:.3} ms",
            ms(median(connects))
        );

        let client = AgentClient::connect_unix(&socket, DEFAULT_PORT)
            .await
            .expect("connect");
        let mut health = Vec::new();
        for _ in 0..200 {
            let t = Instant::now();
            client.health().await.expect("health");
            health.push(t.elapsed());
        }
        println!("health round trip: median {:.3} ms", ms(median(health)));

        let mut runs = Vec::new();
        for _ in 0..100 {
            let t = Instant::now();
            client.run(ExecRequest::argv(["true"])).await.expect("run");
            runs.push(t.elapsed());
        }
        println!(
            "run `true` (spawn, cgroup if any, wait, reply): median {:.3} ms",
            ms(median(runs))
        );

        let t = Instant::now();
        let tasks: Vec<_> = (0..100)
            .map(|_| {
                let client = client.clone();
                tokio::spawn(async move { client.run(ExecRequest::shell("sleep 0.1")).await })
            })
            .collect();
        for task in tasks {
            task.await.expect("join").expect("run");
        }
        println!(
            "100 concurrent `sleep 0.1` runs: {:.0} ms wall",
            ms(t.elapsed())
        );

        let bytes = 256u64 << 20;
        let t = Instant::now();
        let output = client
            .exec(ExecRequest::shell(format!("head -c {bytes} /dev/zero")))
            .await
            .expect("exec")
            .collect()
            .await
            .expect("collect");
        assert_eq!(output.stdout.len() as u64, bytes);
        println!(
            "exec stdout streaming: {:.0} MiB/s",
            256.0 / t.elapsed().as_secs_f64()
        );

        let data = vec![0x5au8; 64 << 20];
        let path = dir.path().join("blob").display().to_string();
        let t = Instant::now();
        client.write_file(&path, &data).await.expect("write");
        println!(
            "write_file 64 MiB (atomic, fsync): {:.0} MiB/s",
            64.0 / t.elapsed().as_secs_f64()
        );
        let t = Instant::now();
        let back = client.read_file(&path).await.expect("read");
        assert_eq!(back.len(), data.len());
        println!(
            "read_file 64 MiB: {:.0} MiB/s",
            64.0 / t.elapsed().as_secs_f64()
        );

        let tree = dir.path().join("tree");
        for i in 0..1000 {
            let sub = tree.join(format!("d{}", i % 20));
            std::fs::create_dir_all(&sub).expect("mkdir");
            std::fs::write(sub.join(format!("f{i}")), vec![b'x'; 4096]).expect("write");
        }
        let t = Instant::now();
        let archive = client
            .tar_download(&tree.display().to_string())
            .await
            .expect("tar");
        println!(
            "tar_download of 1000 files of 4 KiB: {:.1} ms ({} KiB archive)",
            ms(t.elapsed()),
            archive.len() >> 10
        );
        let t = Instant::now();
        client
            .tar_upload(&dir.path().join("copy").display().to_string(), &archive[..])
            .await
            .expect("untar");
        println!("tar_upload of the same: {:.1} ms", ms(t.elapsed()));
    });
    let _ = agent.kill();
    let _ = agent.wait();
}
