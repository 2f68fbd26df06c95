//! After a boot: waiting for the guest's agent, dockerd for a `docker` template, and a
//! template's start command (in the background) and ready command (until it exits 0). After a restore: the guest's address. Every agent call here is bounded: the
//! connection by the agent timeout, each run by its own timeout plus the agent timeout, and
//! the ready loop and dockerd's start by the template's ready timeout.

use std::collections::BTreeMap;
use std::time::Duration;

use rollbox_agent_protocol::client::ClientOptions;
use rollbox_agent_protocol::{AgentClient, ClientError, ExecRequest, NetworkConfig, DEFAULT_PORT};

use super::super::api::{ApiError, SandboxNetwork, State, Template};
use super::super::util::touch;
use super::Guest;

/// How long a template's first boot may take to reach an answering agent (Linux in the nested
/// lab takes tens of seconds).
const BOOT_AGENT_WAIT: Duration = Duration::from_secs(300);
/// How long a template's ready command may take to first exit 0, unless it says.
const READY_WAIT_S: u32 = 300;
/// How long one run of a ready command may take.
const READY_RUN_TIMEOUT_MS: u64 = 10_000;
/// Where the guest keeps the start command's output (`/dev/null` when /var/log is missing).
const START_LOG: &str = "/var/log/rollbox-start.log";

impl Guest {
    /// After a boot of `template`: waits for the agent, starts the template's start command in
    /// the background and runs its ready command until it exits 0. Without a start command,
    /// only waits for the agent of a template known to run one (an image's, or one with a
    /// boot snapshot).
    pub async fn start_template_command(
        &self,
        id: &str,
        template: &Template,
        env: &BTreeMap<String, String>,
    ) -> Result<(), ApiError> {
        if template.docker {
            self.wait_for_agent(id, &template.name).await?;
            self.start_docker(id, template).await?;
        }
        let Some(start_cmd) = &template.start_cmd else {
            // A template whose guest runs the agent (built from an image, or with a boot
            // snapshot) is ready when its agent answers: a create that boots it (volumes, a
            // GPU, another shape) returns then, so its first exec does not race the boot.
            if !template.docker && (template.image.is_some() || template.boot_snapshot.is_some()) {
                self.wait_for_agent(id, &template.name).await?;
            }
            return Ok(());
        };
        let name = &template.name;
        if !template.docker {
            self.wait_for_agent(id, name).await?;
        }
        let client = AgentClient::connect_unix_with(
            self.agent_socket(id)?,
            DEFAULT_PORT,
            self.client_options(),
        )
        .await
        .map_err(|e| ApiError::Unavailable(format!("start_cmd: agent of sandbox {id}: {e}")))?;
        // The shell exits at once; its background child keeps running with its output in a
        // log, so the run's pipes close.
        let launcher = format!(
            "log={START_LOG}; [ -d /var/log ] || log=/dev/null; /bin/sh -c \"$1\" >>\"$log\" 2>&1 </dev/null &"
        );
        let mut request = ExecRequest::argv(["/bin/sh", "-c", &launcher, "sh", start_cmd]);
        request.env = env.clone();
        request.timeout_ms = Some(READY_RUN_TIMEOUT_MS);
        let started = client.run(request).await.map_err(|e| {
            ApiError::Unavailable(format!(
                "start_cmd of template {name:?} in sandbox {id}: {e}"
            ))
        })?;
        if !started.status.success() {
            return Err(ApiError::Unavailable(format!(
                "start_cmd of template {name:?}: the launching shell failed ({:?}): {}",
                started.status,
                String::from_utf8_lossy(&started.stderr).trim()
            )));
        }
        let Some(ready_cmd) = &template.ready_cmd else {
            return Ok(());
        };
        let wait_s = template.ready_timeout_s.unwrap_or(READY_WAIT_S);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(wait_s.into());
        let mut last;
        loop {
            let mut request = ExecRequest::shell(ready_cmd.clone());
            request.env = env.clone();
            request.timeout_ms = Some(READY_RUN_TIMEOUT_MS);
            // Bounded by the run's timeout plus the agent timeout, and by what is left of ours.
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let run = tokio::time::timeout(left.max(Duration::from_secs(1)), client.run(request));
            match run.await.unwrap_or_else(|_| {
                Err(rollbox_agent_protocol::ClientError::Timeout {
                    what: "ready_cmd".into(),
                    after: left,
                })
            }) {
                Ok(output) if output.status.success() => return Ok(()),
                Ok(output) => {
                    last = format!(
                        "last run: {:?}, stderr {:?}",
                        output.status.code,
                        String::from_utf8_lossy(&output.stderr).trim()
                    );
                }
                Err(e) => last = format!("last run: {e}"),
            }
            if tokio::time::Instant::now() >= deadline
                || touch(&self.db, id)?.state != State::Running
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Err(ApiError::Unavailable(format!(
            "ready_cmd of template {name:?} did not exit 0 within {wait_s} s ({last}; the start command's output is in the guest's {START_LOG})"
        )))
    }

    /// A `docker: true` template's boot: the agent starts dockerd, within the template's ready
    /// timeout; a dockerd that does not answer by then fails the boot.
    async fn start_docker(&self, id: &str, template: &Template) -> Result<(), ApiError> {
        let name = &template.name;
        let wait_s = template.ready_timeout_s.unwrap_or(READY_WAIT_S);
        let wait = Duration::from_secs(wait_s.into());
        let client = self.agent(id).await?;
        // The agent gives up after `wait`; the client after `wait` plus the agent timeout.
        let Err(error) = client.docker_ensure(Some(wait)).await else {
            return Ok(());
        };
        Err(ApiError::Unavailable(format!(
            "docker: dockerd of template {name:?} did not come up in sandbox {id} (given {wait_s} s): {error}"
        )))
    }

    /// Addresses the guest's eth0 as `network` says (a restored guest still has its
    /// snapshot's address and MAC): the agent's `configure_network`, within the agent timeout.
    pub async fn configure_network(
        &self,
        id: &str,
        network: &SandboxNetwork,
    ) -> Result<(), ApiError> {
        let config = NetworkConfig {
            device: None,
            address: format!("{}/{}", network.address, network.prefix_len),
            gateway: Some(network.gateway.to_string()),
            dns: network.dns.iter().map(|dns| dns.to_string()).collect(),
            mac: Some(network.mac.clone()),
        };
        // Right after a restore the guest may still be handling the vsock transport reset,
        // which closes connections made before it: a closed connection is tried again
        // (setting the same address twice is harmless) until the agent timeout.
        let deadline = tokio::time::Instant::now() + self.timeout;
        loop {
            let client = self.agent(id).await?;
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let applied = tokio::time::timeout(left, client.configure_network(&config)).await;
            let error = match applied {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(ClientError::Disconnected(_))) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer within {} s", self.timeout.as_secs()),
            };
            return Err(ApiError::Unavailable(format!(
                "network: the agent of sandbox {id} did not take address {}: {error}",
                config.address
            )));
        }
    }

    pub async fn wait_for_agent(&self, id: &str, name: &str) -> Result<(), ApiError> {
        let socket = self.agent_socket(id)?;
        let deadline = tokio::time::Instant::now() + BOOT_AGENT_WAIT;
        let mut last = String::new();
        while tokio::time::Instant::now() < deadline {
            let options = ClientOptions {
                connect_timeout: Some(Duration::from_secs(5)),
                call_timeout: Some(Duration::from_secs(5)),
                stall_timeout: None,
            };
            let attempt = tokio::time::timeout(Duration::from_secs(5), async {
                let client = AgentClient::connect_unix_with(&socket, DEFAULT_PORT, options).await?;
                client.health().await
            })
            .await;
            match attempt {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = "no answer within 5 s".into(),
            }
            if touch(&self.db, id)?.state != State::Running {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(ApiError::Unavailable(format!(
            "boot_snapshot: the agent of template {name:?} did not answer within {} s ({last}); a boot snapshot needs a guest that runs rollbox-agent",
            BOOT_AGENT_WAIT.as_secs()
        )))
    }
}
