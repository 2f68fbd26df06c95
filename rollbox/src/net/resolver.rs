//! The resolver behind hostname entries of an egress policy: for one sandbox, a DNS server on
//! its gateway (`host_ip:53`, UDP and TCP) that answers only its guest's address, forwards to
//! the upstream only A questions for names its policy names (every name under `all`), adds
//! the answered addresses to the entry's nftables set `dns<i>_<tap>` (with a timeout) before
//! the guest gets the answer, and answers everything else itself: NXDOMAIN for a name not on
//! the list (nothing forwarded: a DNS exfiltration channel otherwise), an empty answer for
//! AAAA and other types. An allowed name's private, shared, link-local, loopback or 0/8
//! addresses (DNS rebinding) are dropped from the set and the answer unless a CIDR entry of
//! the policy names them. Design: docs/networking.md, "Hostnames".

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream, UdpSocket};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use super::dns::{self, Query};
use super::nft::{self, Resolved};
use super::policy::{host_matches, rebinding_guarded, Egress};

/// The resolver's port on the gateway.
pub const PORT: u16 = 53;
/// The shortest a resolved address stays allowed, whatever the TTL.
pub const TTL_FLOOR: Duration = Duration::from_secs(60);
/// The longest an answer is believed (the TTL told to the guest, too).
pub const TTL_CAP: Duration = Duration::from_secs(86_400);
/// Added to every set entry's timeout: a guest that uses an address until its TTL ends still
/// connects after a little clock skew or a slow handshake.
pub const GRACE: Duration = Duration::from_secs(30);
/// Queries of one sandbox being answered at once, at most (more are dropped).
const IN_FLIGHT: usize = 32;
/// TCP connections of one sandbox at once, at most.
const TCP_CONNECTIONS: usize = 8;
/// A TCP connection is closed after this long without a query.
const TCP_IDLE: Duration = Duration::from_secs(10);

/// Why a resolver did not start.
#[derive(Debug, thiserror::Error)]
pub enum ResolverError {
    #[error("resolver for {tap}: binding {addr}: {source} (does another DNS server listen on every address's port 53?)")]
    Bind {
        tap: String,
        addr: SocketAddrV4,
        source: std::io::Error,
    },
}

/// How a resolver answers.
#[derive(Debug, Clone)]
pub struct ResolverOptions {
    /// Where allowed names are resolved (`rollbox serve --sandbox-dns`, else the host's).
    pub upstream: SocketAddr,
    /// See [`TTL_FLOOR`] and [`GRACE`]: a set entry lasts max(TTL, floor) + grace.
    pub ttl_floor: Duration,
    pub grace: Duration,
    /// How long the upstream has to answer.
    pub upstream_timeout: Duration,
    /// The port on the gateway ([`PORT`]; tests may pick another).
    pub port: u16,
}

impl ResolverOptions {
    pub fn new(upstream: SocketAddr) -> ResolverOptions {
        ResolverOptions {
            upstream,
            ttl_floor: TTL_FLOOR,
            grace: GRACE,
            upstream_timeout: Duration::from_secs(3),
            port: PORT,
        }
    }
}

/// The sandbox a resolver serves.
#[derive(Debug, Clone)]
pub struct Site {
    pub tap: String,
    pub host_ip: Ipv4Addr,
    pub guest_ip: Ipv4Addr,
}

/// An address answered for a name, until when it is in its sets.
#[derive(Debug, Clone)]
struct Answered {
    name: String,
    addr: Ipv4Addr,
    until: Instant,
}

struct State {
    egress: Egress,
    answered: Vec<Answered>,
    /// Set when the resolver is dropped: no set is written after (its tap, and the set
    /// names, may soon be another sandbox's).
    closed: bool,
}

struct Shared {
    site: Site,
    options: ResolverOptions,
    /// Held while a set is written (by a query or a policy change), so an address is never
    /// added to a set under another policy than the one it was answered for.
    state: Mutex<State>,
    in_flight: Arc<Semaphore>,
    connections: Arc<Semaphore>,
}

/// A running resolver; its tasks end when it is dropped.
pub struct Resolver {
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Resolver {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        // Waits for a set being written; queries still in flight write none after this.
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .closed = true;
    }
}

impl Resolver {
    /// Binds `site.host_ip:port` (UDP and TCP; the address must be on the sandbox's tap) and
    /// serves on `runtime`.
    pub fn start(
        site: Site,
        egress: Egress,
        options: ResolverOptions,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Resolver, ResolverError> {
        let addr = SocketAddrV4::new(site.host_ip, options.port);
        let bind = |source| ResolverError::Bind {
            tap: site.tap.clone(),
            addr,
            source,
        };
        let _entered = runtime.enter();
        let udp = std::net::UdpSocket::bind(addr).map_err(bind)?;
        udp.set_nonblocking(true).map_err(bind)?;
        let udp = UdpSocket::from_std(udp).map_err(bind)?;
        let tcp = TcpSocket::new_v4().map_err(bind)?;
        tcp.set_reuseaddr(true).map_err(bind)?;
        tcp.bind(addr.into()).map_err(bind)?;
        let tcp = tcp.listen(16).map_err(bind)?;
        let shared = Arc::new(Shared {
            site,
            options,
            state: Mutex::new(State {
                egress,
                answered: Vec::new(),
                closed: false,
            }),
            in_flight: Arc::new(Semaphore::new(IN_FLIGHT)),
            connections: Arc::new(Semaphore::new(TCP_CONNECTIONS)),
        });
        let tasks = vec![
            runtime.spawn(serve_udp(Arc::clone(&shared), Arc::new(udp))),
            runtime.spawn(serve_tcp(Arc::clone(&shared), tcp)),
        ];
        Ok(Resolver { shared, tasks })
    }

    /// Changes the policy the resolver answers by: `apply` gets what the sets should keep
    /// (addresses answered for names the new policy still allows, with what is left of their
    /// timeouts) and replaces the rules (`rollbox::net::set_egress`); on success the resolver
    /// answers by `egress`. Blocking; no set is written meanwhile.
    pub fn set_egress<T, E>(
        &self,
        egress: &Egress,
        apply: impl FnOnce(&[Resolved]) -> Result<T, E>,
    ) -> Result<T, E> {
        let mut state = self
            .shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let now = Instant::now();
        state.answered.retain(|a| a.until > now);
        let mut keep = Vec::new();
        for (index, (pattern, _)) in egress.hosts().iter().enumerate() {
            for answered in &state.answered {
                if host_matches(pattern, &answered.name) && admitted(egress, answered.addr) {
                    keep.push(Resolved {
                        set: index,
                        addr: answered.addr,
                        timeout_s: answered.until.duration_since(now).as_secs().max(1),
                    });
                }
            }
        }
        let done = apply(&keep)?;
        state.egress = egress.clone();
        Ok(done)
    }
}

/// Whether an answered address may go into a set: not in a rebinding range, unless a CIDR
/// entry of the policy names it.
fn admitted(egress: &Egress, addr: Ipv4Addr) -> bool {
    !rebinding_guarded(addr) || egress.names_address(addr)
}

async fn serve_udp(shared: Arc<Shared>, socket: Arc<UdpSocket>) {
    let mut buf = vec![0u8; 4096];
    loop {
        let Ok((len, from)) = socket.recv_from(&mut buf).await else {
            // Not a busy loop if the error persists.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        // Over IN_FLIGHT queries at once, more are dropped (the guest retries).
        let Ok(permit) = Arc::clone(&shared.in_flight).try_acquire_owned() else {
            continue;
        };
        let msg = buf[..len].to_vec();
        let (shared, socket) = (Arc::clone(&shared), Arc::clone(&socket));
        tokio::spawn(async move {
            if let Some(reply) = answer(&shared, &msg, from, dns::MAX_UDP).await {
                let _ = socket.send_to(&reply, from).await;
            }
            drop(permit);
        });
    }
}

async fn serve_tcp(shared: Arc<Shared>, listener: TcpListener) {
    loop {
        let Ok((stream, from)) = listener.accept().await else {
            // Out of descriptors, say: not a busy loop.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        if from.ip() != shared.site.guest_ip {
            continue;
        }
        let Ok(permit) = Arc::clone(&shared.connections).try_acquire_owned() else {
            continue;
        };
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            let _ = serve_connection(&shared, stream, from).await;
            drop(permit);
        });
    }
}

/// Length-prefixed queries on one TCP connection, until it idles or closes.
async fn serve_connection(
    shared: &Arc<Shared>,
    mut stream: TcpStream,
    from: SocketAddr,
) -> std::io::Result<()> {
    loop {
        let mut len = [0u8; 2];
        tokio::time::timeout(TCP_IDLE, stream.read_exact(&mut len)).await??;
        let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
        tokio::time::timeout(TCP_IDLE, stream.read_exact(&mut msg)).await??;
        let Some(reply) = answer(shared, &msg, from, usize::from(u16::MAX)).await else {
            return Ok(());
        };
        let len = u16::try_from(reply.len()).unwrap_or(u16::MAX);
        stream.write_all(&len.to_be_bytes()).await?;
        stream.write_all(&reply[..usize::from(len)]).await?;
    }
}

/// Answers one query of the guest's; None for anything not from the guest's address, or
/// that is not a query at all.
async fn answer(
    shared: &Arc<Shared>,
    msg: &[u8],
    from: SocketAddr,
    max_len: usize,
) -> Option<Vec<u8>> {
    if from.ip() != shared.site.guest_ip {
        return None;
    }
    let query = match dns::parse_query(msg) {
        Ok(query) => query,
        Err(_) => return dns::query_id(msg).map(dns::build_formerr),
    };
    let reply = |rcode, addresses: &[(Ipv4Addr, u32)]| {
        Some(dns::build_reply(&query, rcode, addresses, max_len))
    };
    let question = &query.question;
    if question.qclass != dns::CLASS_IN {
        return reply(dns::REFUSED, &[]);
    }
    let (forward_all, matched) = {
        let state = shared.state.lock().unwrap_or_else(PoisonError::into_inner);
        let matched: Vec<usize> = state
            .egress
            .hosts()
            .iter()
            .enumerate()
            .filter(|(_, (pattern, _))| host_matches(pattern, &question.name))
            .map(|(index, _)| index)
            .collect();
        (matches!(state.egress, Egress::All(_)), matched)
    };
    if matched.is_empty() && !forward_all {
        // Not on the list: answered here, nothing forwarded.
        return reply(dns::NXDOMAIN, &[]);
    }
    if question.qtype != dns::TYPE_A {
        // Guests are IPv4 only; other types are not forwarded either.
        return reply(dns::NOERROR, &[]);
    }
    let answer = match ask_upstream(&shared.options, &question.name).await {
        Ok(answer) => answer,
        Err(e) => {
            log::debug!("resolver for {}: {}: {e}", shared.site.tap, question.name);
            return reply(dns::SERVFAIL, &[]);
        }
    };
    if answer.rcode != dns::NOERROR {
        return reply(answer.rcode, &[]);
    }
    let addresses = admit(shared, &query, &answer.addresses).await?;
    reply(dns::NOERROR, &addresses)
}

/// Puts an allowed name's addresses into its entries' sets (under the policy in force while
/// the set is written) and returns those the guest is told: the admitted ones, or, for a
/// name only `all` forwards, all of them. None when the sets could not be written.
async fn admit(
    shared: &Arc<Shared>,
    query: &Query,
    addresses: &[(Ipv4Addr, u32)],
) -> Option<Vec<(Ipv4Addr, u32)>> {
    let name = query.question.name.clone();
    let addresses = addresses.to_vec();
    let shared = Arc::clone(shared);
    // The set is written under the state lock, off the async threads (`nft` blocks).
    let written = tokio::task::spawn_blocking(move || {
        let mut state = shared.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.closed {
            return None;
        }
        let matched: Vec<usize> = state
            .egress
            .hosts()
            .iter()
            .enumerate()
            .filter(|(_, (pattern, _))| host_matches(pattern, &name))
            .map(|(index, _)| index)
            .collect();
        if matched.is_empty() {
            // Only `all` forwarded it (or the policy changed meanwhile and names it no more).
            return if matches!(state.egress, Egress::All(_)) {
                Some(addresses)
            } else {
                Some(Vec::new())
            };
        }
        let cap = u32::try_from(TTL_CAP.as_secs()).unwrap_or(u32::MAX);
        let admitted: Vec<(Ipv4Addr, u32)> = addresses
            .into_iter()
            .filter(|(addr, _)| admitted(&state.egress, *addr))
            .map(|(addr, ttl)| (addr, ttl.min(cap)))
            .collect();
        let now = Instant::now();
        state.answered.retain(|a| a.until > now);
        let patterns: Vec<String> = state
            .egress
            .hosts()
            .iter()
            .map(|(pattern, _)| pattern.to_string())
            .collect();
        let mut elements = Vec::new();
        let mut fresh = Vec::new();
        for (addr, ttl) in &admitted {
            let lasts = Duration::from_secs(u64::from(*ttl)).max(shared.options.ttl_floor)
                + shared.options.grace;
            // Written less than half its time ago: the sets hold it long enough; no nft
            // transaction for a name looked up again soon.
            let recent = state
                .answered
                .iter()
                .any(|a| a.name == name && a.addr == *addr && a.until >= now + lasts / 2);
            if recent {
                continue;
            }
            for &set in &matched {
                // Never shorter than what another name of this entry still has on it (a
                // refresh replaces the element).
                let others = state
                    .answered
                    .iter()
                    .filter(|a| a.addr == *addr && host_matches(&patterns[set], &a.name))
                    .map(|a| a.until.duration_since(now))
                    .max()
                    .unwrap_or_default();
                elements.push(Resolved {
                    set,
                    addr: *addr,
                    timeout_s: lasts.max(others).as_secs().max(1),
                });
            }
            fresh.push((*addr, now + lasts));
        }
        if !elements.is_empty() {
            if let Err(e) = nft::apply(&nft::render_resolved(&shared.site.tap, &elements)) {
                log::warn!(
                    "resolver for {}: adding {name}'s addresses: {e}",
                    shared.site.tap
                );
                return None;
            }
        }
        // Recorded once written (what a later PATCH keeps, and what "recent" trusts).
        for (addr, until) in fresh {
            state
                .answered
                .retain(|a| !(a.name == name && a.addr == addr));
            state.answered.push(Answered {
                name: name.clone(),
                addr,
                until,
            });
        }
        Some(admitted)
    });
    written.await.ok().flatten()
}

/// Asks the upstream for `name`'s A records: UDP from a fresh port with a random id, and
/// again over TCP when the answer was truncated.
async fn ask_upstream(options: &ResolverOptions, name: &str) -> Result<dns::Answer, String> {
    let id = random_id();
    let query = dns::build_query(id, name, dns::TYPE_A);
    let bind: SocketAddr = match options.upstream {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(bind).await.map_err(|e| e.to_string())?;
    socket
        .connect(options.upstream)
        .await
        .map_err(|e| e.to_string())?;
    socket.send(&query).await.map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 4096];
    let deadline = tokio::time::Instant::now() + options.upstream_timeout;
    let answer = loop {
        let len = tokio::time::timeout_at(deadline, socket.recv(&mut buf))
            .await
            .map_err(|_| format!("no answer from {} in time", options.upstream))?
            .map_err(|e| e.to_string())?;
        // A stray datagram (another id) is skipped; the connected socket takes only the
        // upstream's.
        match dns::parse_answer(&buf[..len], id, name) {
            Ok(answer) => break answer,
            Err(dns::DnsError::Mismatch(_)) => continue,
            Err(e) => return Err(e.to_string()),
        }
    };
    if !answer.truncated {
        return Ok(answer);
    }
    let ask = async {
        let mut stream = TcpStream::connect(options.upstream).await?;
        let len = u16::try_from(query.len()).unwrap_or(u16::MAX);
        stream.write_all(&len.to_be_bytes()).await?;
        stream.write_all(&query).await?;
        let mut len = [0u8; 2];
        stream.read_exact(&mut len).await?;
        let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
        stream.read_exact(&mut msg).await?;
        Ok::<_, std::io::Error>(msg)
    };
    let msg = tokio::time::timeout(options.upstream_timeout, ask)
        .await
        .map_err(|_| format!("no TCP answer from {} in time", options.upstream))?
        .map_err(|e| e.to_string())?;
    dns::parse_answer(&msg, id, name).map_err(|e| e.to_string())
}

/// A random query id (getrandom; the time's nanoseconds if that fails).
fn random_id() -> u16 {
    let mut id = [0u8; 2];
    // SAFETY: getrandom writes at most the two bytes of the live buffer it is given.
    let filled = unsafe { libc::getrandom(id.as_mut_ptr().cast(), id.len(), 0) };
    if filled == 2 {
        return u16::from_ne_bytes(id);
    }
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rebinding_answers_are_admitted_only_when_a_cidr_names_them() {
        let egress: Egress = "pypi.org:443,10.1.0.0/16:5432".parse().unwrap();
        assert!(admitted(&egress, Ipv4Addr::new(151, 101, 0, 223)));
        assert!(admitted(&egress, Ipv4Addr::new(10, 1, 2, 3)));
        assert!(!admitted(&egress, Ipv4Addr::new(10, 2, 0, 1)));
        assert!(!admitted(&egress, Ipv4Addr::new(127, 0, 0, 1)));
        assert!(!admitted(&egress, Ipv4Addr::new(169, 254, 169, 254)));
        assert!(!admitted(&egress, Ipv4Addr::new(0, 0, 0, 0)));
    }
}
