//! Private registries, for real (tier 2, host): the test starts two `docker-registry` processes
//! of its own on free loopback ports, one with htpasswd (bcrypt, from `htpasswd -Bbn`) basic
//! auth and one with token auth backed by a token server written here (it checks basic
//! credentials and issues RS256 JWTs signed with a key and certificate made by the `openssl`
//! CLI, the certificate in the header's `x5c` and in the registry's `rootcertbundle`), pushes
//! a small image into each with credentials, and then builds it:
//! - with `rollbox image build --registry-auth FILE`: right credentials build, a wrong
//!   password and no credentials are one-line errors naming the registry;
//! - through `rollbox serve`: with `--registry-auth FILE`, with a request's `image.auth` (a
//!   user and password, or a registry token from the token server) and with `rollbox template
//!   build --registry-auth FILE`; a wrong password or none is a 403
//!   naming the registry; no password is in the state directory (the SQLite state DB), the
//!   daemon's log or any reply.
//!
//! Needs root (the image builder), docker-registry, htpasswd (apache2-utils) and openssl
//! (`scripts/setup.sh`); a missing one is a skip, a failure under ROLLBOX_REQUIRE_ALL=1.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use oci_client::secrets::RegistryAuth;
use rollbox_tests::daemon::{cli, cli_output, Server};
use rollbox_tests::images::{self, Image, Layer};
use rollbox_tests::skip;
use serde_json::{json, Value};

const BASIC_USER: &str = "alice";
const BASIC_PASSWORD: &str = "basic-pw-7f3a9e1c";
const TOKEN_USER: &str = "bob";
const TOKEN_PASSWORD: &str = "token-pw-c41e2b8d";
/// Wrong passwords, distinct so that none of them hides in another.
const WRONG_BASIC: &str = "wrong-basic-5d21";
const WRONG_TOKEN: &str = "wrong-token-93aa";
const SERVICE: &str = "rollbox-test-registry";
const ISSUER: &str = "rollbox-test-token-issuer";
const REPOSITORY: &str = "private/tiny";

fn on_path(name: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(name).is_file()))
}

/// Root and the tools, or a skip (a failure under ROLLBOX_REQUIRE_ALL=1).
fn prerequisites(test: &str) -> bool {
    if !images::root_or_skip(test) {
        return false;
    }
    let missing: Vec<&str> = ["docker-registry", "htpasswd", "openssl"]
        .into_iter()
        .filter(|tool| !on_path(tool))
        .collect();
    if !missing.is_empty() {
        skip(
            test,
            &format!(
                "missing {} (scripts/setup.sh installs docker-registry, apache2-utils, openssl)",
                missing.join(", ")
            ),
        );
        return false;
    }
    true
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

fn run(command: &mut Command) -> Vec<u8> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output.stdout
}

/// A `docker-registry serve` of this test's, killed on drop.
struct Registry {
    child: Child,
    /// `127.0.0.1:PORT`.
    addr: String,
}

impl Registry {
    /// Starts one with its own config and storage under `dir/name`, with `auth` (YAML, the
    /// config's `auth:` section), and waits until GET /v2/ answers 401.
    fn start(dir: &Path, name: &str, auth: &str) -> Registry {
        let home = dir.join(name);
        std::fs::create_dir_all(home.join("storage")).expect("registry dir");
        let addr = format!("127.0.0.1:{}", free_port());
        let config = home.join("config.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: {addr}\nauth:\n{auth}",
                home.join("storage").display()
            ),
        )
        .expect("registry config");
        let log = std::fs::File::create(home.join("registry.log")).expect("registry log");
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn docker-registry");
        let mut registry = Registry { child, addr };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if registry.v2_status().as_deref() == Some("401") {
                return registry;
            }
            let log = || std::fs::read_to_string(home.join("registry.log")).unwrap_or_default();
            if let Ok(Some(status)) = registry.child.try_wait() {
                panic!("registry {name} ended ({status}):\n{}", log());
            }
            assert!(
                Instant::now() < deadline,
                "registry {name} did not answer 401 on {}/v2/:\n{}",
                registry.addr,
                log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The status of an anonymous GET /v2/.
    fn v2_status(&self) -> Option<String> {
        let mut stream = TcpStream::connect(&self.addr).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        let request = format!("GET /v2/ HTTP/1.0\r\nHost: {}\r\n\r\n", self.addr);
        stream.write_all(request.as_bytes()).ok()?;
        let mut head = [0u8; 16];
        let n = stream.read(&mut head).ok()?;
        let head = String::from_utf8_lossy(&head[..n]).to_string();
        head.split_whitespace().nth(1).map(str::to_string)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The token server's signing key and certificate (RSA, made with the openssl CLI).
struct Signer {
    dir: PathBuf,
    key: PathBuf,
    /// The certificate, DER, base64 (for the JWT header's `x5c`).
    cert_b64: String,
    serial: AtomicU64,
}

fn b64url(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

impl Signer {
    /// A self-signed key and certificate under `dir`; the PEM certificate is `dir/token.pem`.
    fn new(dir: &Path) -> Signer {
        let key = dir.join("token.key");
        run(Command::new("openssl")
            .args([
                "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            ])
            .args(["-subj", "/CN=rollbox token test"])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(dir.join("token.pem")));
        let der = run(Command::new("openssl")
            .args(["x509", "-outform", "DER", "-in"])
            .arg(dir.join("token.pem")));
        Signer {
            dir: dir.to_path_buf(),
            key,
            cert_b64: base64::engine::general_purpose::STANDARD.encode(der),
            serial: AtomicU64::new(0),
        }
    }

    /// An RS256 JWT granting `access` (the registry's `access` claim) for a minute.
    fn token(&self, subject: &str, access: Value) -> String {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("time")
            .as_secs();
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let header = json!({"typ": "JWT", "alg": "RS256", "x5c": [self.cert_b64]});
        let claims = json!({
            "iss": ISSUER, "sub": subject, "aud": SERVICE,
            "exp": now + 60, "nbf": now - 10, "iat": now,
            "jti": format!("rollbox-test-{}-{serial}", std::process::id()),
            "access": access,
        });
        let input = format!(
            "{}.{}",
            b64url(header.to_string().as_bytes()),
            b64url(claims.to_string().as_bytes())
        );
        let file = self.dir.join(format!("jwt-{serial}"));
        std::fs::write(&file, &input).expect("write the JWT's signing input");
        let signature = run(Command::new("openssl")
            .args(["dgst", "-sha256", "-binary", "-sign"])
            .arg(&self.key)
            .arg(&file));
        format!("{input}.{}", b64url(&signature))
    }
}

/// A token server on a loopback port: GET /token?service=..&scope=.. with basic credentials
/// answers a JWT granting the scopes asked for to TOKEN_USER with TOKEN_PASSWORD, one granting
/// nothing to an anonymous caller (as Docker Hub does), and 401 to wrong credentials.
struct TokenServer {
    addr: String,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl TokenServer {
    fn start(signer: Signer) -> TokenServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the token server");
        let addr = listener.local_addr().expect("its address").to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            for stream in listener.incoming() {
                if stopped.load(Ordering::Relaxed) {
                    break;
                }
                if let Ok(stream) = stream {
                    answer(stream, &signer);
                }
            }
        });
        TokenServer {
            addr,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop.
        let _ = TcpStream::connect(&self.addr);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One request of the token server.
fn answer(mut stream: TcpStream, signer: &Signer) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let mut request = Vec::new();
    let mut buf = [0u8; 4096];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 65536 {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => request.extend_from_slice(&buf[..n]),
        }
    }
    let request = String::from_utf8_lossy(&request).into_owned();
    let target = request.split_whitespace().nth(1).unwrap_or("");
    let query = target.split_once('?').map_or("", |(_, q)| q);
    let mut scopes = Vec::new();
    let mut service = String::new();
    for pair in query.split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "scope" => scopes.push(percent_decode(value)),
            "service" => service = percent_decode(value),
            _ => {}
        }
    }
    let basic = request.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        if !name.eq_ignore_ascii_case("authorization") {
            return None;
        }
        let encoded = value.trim().strip_prefix("Basic ")?;
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .ok()?;
        Some(String::from_utf8_lossy(&decoded).into_owned())
    });
    let expected = format!("{TOKEN_USER}:{TOKEN_PASSWORD}");
    let (status, body) = match basic {
        Some(pair) if pair != expected => (
            "401 Unauthorized",
            json!({"errors": [{"code": "UNAUTHORIZED", "message": "bad username or password"}]}),
        ),
        _ if service != SERVICE => (
            "400 Bad Request",
            json!({"errors": [{"code": "DENIED", "message": format!("unknown service {service:?}")}]}),
        ),
        known => {
            let access: Vec<Value> = if known.is_some() {
                scopes
                    .iter()
                    .filter_map(|scope| {
                        let (kind, rest) = scope.split_once(':')?;
                        let (name, actions) = rest.rsplit_once(':')?;
                        Some(json!({"type": kind, "name": name, "actions": actions.split(',').collect::<Vec<_>>()}))
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let subject = if known.is_some() { TOKEN_USER } else { "" };
            let token = signer.token(subject, json!(access));
            (
                "200 OK",
                json!({"token": token, "access_token": token, "expires_in": 60}),
            )
        }
    };
    let body = body.to_string();
    let reply = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(reply.as_bytes());
}

/// A one-layer image whose /etc/hello names `kind`.
fn hello_image(kind: &str) -> Image {
    Image::new(vec![Layer::new()
        .dir("etc", 0o755, 0, 0)
        .file(
            "etc/hello",
            format!("from the {kind} registry\n").as_bytes(),
            0o644,
            0,
            0,
        )
        .tar()])
}

/// The two registries, the token server, a small image pushed into each, and credentials
/// files.
struct Setup {
    work: tempfile::TempDir,
    basic: Registry,
    token: Registry,
    tokens: TokenServer,
}

impl Setup {
    fn start() -> Setup {
        let work = tempfile::tempdir().expect("tempdir");
        let dir = work.path();
        let htpasswd = run(Command::new("htpasswd").args(["-Bbn", BASIC_USER, BASIC_PASSWORD]));
        std::fs::write(dir.join("htpasswd"), htpasswd).expect("write htpasswd");
        let basic = Registry::start(
            dir,
            "basic",
            &format!(
                "  htpasswd:\n    realm: rollbox-test\n    path: {}\n",
                dir.join("htpasswd").display()
            ),
        );
        let signer = Signer::new(dir);
        let tokens = TokenServer::start(signer);
        let token = Registry::start(
            dir,
            "token",
            &format!(
                "  token:\n    realm: http://{}/token\n    service: {SERVICE}\n    issuer: {ISSUER}\n    rootcertbundle: {}\n",
                tokens.addr,
                dir.join("token.pem").display()
            ),
        );
        let setup = Setup {
            work,
            basic,
            token,
            tokens,
        };
        // Each its own image, so each build pulls its layer (under that registry's auth).
        hello_image("basic").push_with(
            &setup.basic_ref(),
            &RegistryAuth::Basic(BASIC_USER.into(), BASIC_PASSWORD.into()),
        );
        hello_image("token").push_with(
            &setup.token_ref(),
            &RegistryAuth::Basic(TOKEN_USER.into(), TOKEN_PASSWORD.into()),
        );
        setup
    }

    fn basic_ref(&self) -> String {
        format!("{}/{REPOSITORY}:v1", self.basic.addr)
    }

    fn token_ref(&self) -> String {
        format!("{}/{REPOSITORY}:v1", self.token.addr)
    }

    /// A pull token for the token registry's image, from the token server, as a client
    /// that logged in elsewhere would hold it.
    fn pull_token(&self) -> String {
        let mut stream = TcpStream::connect(&self.tokens.addr).expect("connect the token server");
        let basic = base64::engine::general_purpose::STANDARD
            .encode(format!("{TOKEN_USER}:{TOKEN_PASSWORD}"));
        let request = format!(
            "GET /token?service={SERVICE}&scope=repository%3A{}%3Apull HTTP/1.0\r\nAuthorization: Basic {basic}\r\n\r\n",
            REPOSITORY.replace('/', "%2F")
        );
        stream
            .write_all(request.as_bytes())
            .expect("ask for a token");
        let mut reply = String::new();
        stream
            .read_to_string(&mut reply)
            .expect("the token server's reply");
        let body = reply.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        let json: Value = serde_json::from_str(body).expect("a token reply");
        json["token"].as_str().expect("a token").to_string()
    }

    fn dir(&self) -> &Path {
        self.work.path()
    }

    /// A Docker config.json: the htpasswd registry's entry as `auth` under `https://HOST/v1/`
    /// (as `docker login` writes it), the token registry's as username and password.
    fn credentials(&self, name: &str, basic_password: &str, token_password: &str) -> PathBuf {
        let auth = base64::engine::general_purpose::STANDARD
            .encode(format!("{BASIC_USER}:{basic_password}"));
        let config = json!({"auths": {
            format!("https://{}/v1/", self.basic.addr): {"auth": auth},
            self.token.addr.clone(): {"username": TOKEN_USER, "password": token_password},
            "ghcr.io": {"auth": base64::engine::general_purpose::STANDARD.encode("other:registry")},
        }});
        let path = self.dir().join(name);
        std::fs::write(&path, config.to_string()).expect("write config.json");
        path
    }
}

/// `rollbox image build` of `reference` into the test's cache, with `extra` flags.
fn image_build(setup: &Setup, reference: &str, extra: &[&str]) -> Output {
    let agent = images::agent().display().to_string();
    let cache = setup.dir().join("cache").display().to_string();
    let mut args = vec![
        "image",
        "build",
        reference,
        "--agent",
        &agent,
        "--cache-dir",
        &cache,
    ];
    args.extend_from_slice(extra);
    images::rollbox(&args)
}

/// A failed command's one-line error.
fn one_line_error(output: &Output) -> String {
    assert!(!output.status.success(), "it should have failed");
    let stderr = String::from_utf8_lossy(&output.stderr).trim().to_string();
    assert_eq!(stderr.lines().count(), 1, "not one line: {stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    stderr
}

fn assert_no_secret(what: &str, text: &[u8]) {
    for secret in [BASIC_PASSWORD, TOKEN_PASSWORD, WRONG_BASIC, WRONG_TOKEN] {
        assert!(
            !text.windows(secret.len()).any(|w| w == secret.as_bytes()),
            "{what} holds the password {secret}"
        );
    }
}

#[test]
fn image_build_pulls_with_credentials_from_basic_and_token_registries() {
    let test = "image_build_pulls_with_credentials_from_basic_and_token_registries";
    if !prerequisites(test) {
        return;
    }
    let setup = Setup::start();
    let right = setup.credentials("right.json", BASIC_PASSWORD, TOKEN_PASSWORD);
    let wrong = setup.credentials("wrong.json", WRONG_BASIC, WRONG_TOKEN);
    let elsewhere = setup.dir().join("elsewhere.json");
    std::fs::write(
        &elsewhere,
        json!({"auths": {"127.0.0.1:1": {"auth": "YTpi"}}}).to_string(),
    )
    .expect("write config.json");
    let right = right.display().to_string();
    let wrong = wrong.display().to_string();
    let elsewhere = elsewhere.display().to_string();

    for (kind, registry, reference) in [
        ("basic", &setup.basic.addr, setup.basic_ref()),
        ("token", &setup.token.addr, setup.token_ref()),
    ] {
        let output = setup
            .dir()
            .join(format!("{}.ext4", registry.replace(':', "-")));
        let built = image_build(
            &setup,
            &reference,
            &[
                "--registry-auth",
                &right,
                "-o",
                &output.display().to_string(),
            ],
        );
        assert!(built.status.success(), "{reference} with right credentials");
        let hello = images::cat(&output, "/etc/hello");
        assert_eq!(hello, format!("from the {kind} registry\n").as_bytes());

        // Refused after a good build too: the cache is no way around the registry.
        let error = one_line_error(&image_build(
            &setup,
            &reference,
            &["--registry-auth", &wrong],
        ));
        assert!(
            error.contains(&format!(
                "registry {registry} refused the credentials for {reference}"
            )),
            "{error}"
        );
        assert_no_secret("the error", error.as_bytes());
        for extra in [&[][..], &["--registry-auth", &elsewhere][..]] {
            let error = one_line_error(&image_build(&setup, &reference, extra));
            assert!(
                error.contains(&format!(
                    "registry {registry} refused anonymous access to {reference}"
                )),
                "{extra:?}: {error}"
            );
        }
    }
    let error = one_line_error(&image_build(
        &setup,
        &setup.basic_ref(),
        &["--registry-auth", "/nonexistent/config.json"],
    ));
    assert!(error.contains("/nonexistent/config.json"), "{error}");
}

/// `rollbox template build` against `server`, expected to fail: its output.
fn template_build_fails(server: &Server, args: &[&str]) -> Output {
    let output = cli_output(server, args);
    eprintln!(
        "$ rollbox {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// Every file under `dir` (not the built ext4 images): (path, bytes).
fn files_under(dir: &Path, found: &mut Vec<(PathBuf, Vec<u8>)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files_under(&path, found);
        } else if path.extension().is_none_or(|e| e != "ext4") {
            if let Ok(bytes) = std::fs::read(&path) {
                found.push((path, bytes));
            }
        }
    }
}

#[test]
fn serve_builds_templates_with_its_file_or_the_requests_credentials_and_keeps_none() {
    let test = "serve_builds_templates_with_its_file_or_the_requests_credentials_and_keeps_none";
    if !prerequisites(test) {
        return;
    }
    let setup = Setup::start();
    // The daemon's file has the htpasswd registry's entry only.
    let serve_file = setup.dir().join("serve.json");
    std::fs::write(
        &serve_file,
        json!({"auths": {setup.basic.addr.clone(): {"username": BASIC_USER, "password": BASIC_PASSWORD}}})
            .to_string(),
    )
    .expect("write config.json");
    let kernel = setup.dir().join("vmlinux");
    std::fs::write(&kernel, b"never booted").expect("write kernel");
    let agent = images::agent().display().to_string();
    let cache = setup.dir().join("cache").display().to_string();
    let server = Server::start(&[
        "--agent",
        &agent,
        "--image-cache",
        &cache,
        "--registry-auth",
        &serve_file.display().to_string(),
    ]);
    let add = |name: &str, image: Value| {
        server.call(
            "POST",
            "/templates",
            Some(json!({"name": name, "kernel": kernel, "image": image})),
        )
    };
    let (token_addr, token_ref) = (&setup.token.addr, setup.token_ref());
    let (basic_addr, basic_ref) = (&setup.basic.addr, setup.basic_ref());

    // The daemon's --registry-auth.
    let (status, body) = add("from-file", json!({"reference": basic_ref}));
    assert_eq!(status, 201, "{body}");
    assert!(
        body["image"]
            .as_str()
            .is_some_and(|i| i.starts_with(&format!("{basic_ref}@sha256:"))),
        "{body}"
    );
    // The request's credentials, through the token server.
    let (status, body) = add(
        "per-request",
        json!({"reference": token_ref, "auth": {"username": TOKEN_USER, "password": TOKEN_PASSWORD}}),
    );
    assert_eq!(status, 201, "{body}");
    assert_no_secret("the reply", body.to_string().as_bytes());
    // A registry token the caller already holds, sent as a bearer token.
    let token = setup.pull_token();
    let (status, body) = add(
        "with-token",
        json!({"reference": token_ref, "auth": {"token": token}}),
    );
    assert_eq!(status, 201, "{body}");
    assert!(
        !body.to_string().contains(&token),
        "the reply holds the token: {body}"
    );

    // Refusals are 403s naming the registry, and leave no template.
    for (name, image, expected) in [
        (
            "wrong-token",
            json!({"reference": token_ref, "auth": {"username": TOKEN_USER, "password": WRONG_TOKEN}}),
            format!("registry {token_addr} refused the credentials for {token_ref}"),
        ),
        (
            "no-credentials",
            json!({"reference": token_ref}),
            format!("registry {token_addr} refused anonymous access to {token_ref}"),
        ),
        (
            // The request's credentials win over the daemon's file.
            "wrong-basic",
            json!({"reference": basic_ref, "auth": {"username": BASIC_USER, "password": WRONG_BASIC}}),
            format!("registry {basic_addr} refused the credentials for {basic_ref}"),
        ),
    ] {
        let (status, body) = add(name, image);
        assert_eq!(status, 403, "{name}: {body}");
        let error = body["error"].as_str().unwrap_or_default();
        assert!(error.contains(&expected), "{name}: {error}");
        assert_no_secret("the error", body.to_string().as_bytes());
        let (status, _) = server.call("GET", &format!("/templates/{name}"), None);
        assert_eq!(status, 404, "{name} was left");
    }

    // `rollbox template build --registry-auth FILE` sends its entry with the request.
    let right = setup.credentials("right.json", BASIC_PASSWORD, TOKEN_PASSWORD);
    let wrong = setup.credentials("wrong.json", WRONG_BASIC, WRONG_TOKEN);
    let kernel_arg = kernel.display().to_string();
    let out = cli(
        &server,
        &[
            "template",
            "build",
            &token_ref,
            "--kernel",
            &kernel_arg,
            "--name",
            "via-cli",
            "--registry-auth",
            &right.display().to_string(),
        ],
    );
    assert!(out.contains("template via-cli built"), "{out}");
    let failed = template_build_fails(
        &server,
        &[
            "template",
            "build",
            &token_ref,
            "--kernel",
            &kernel_arg,
            "--name",
            "via-cli-wrong",
            "--registry-auth",
            &wrong.display().to_string(),
        ],
    );
    let error = one_line_error(&failed);
    assert!(
        error.contains(&format!(
            "registry {token_addr} refused the credentials for {token_ref}"
        )),
        "{error}"
    );

    // No password anywhere the daemon keeps or says things.
    let (status, list) = server.call("GET", "/templates", None);
    assert_eq!(status, 200);
    assert_eq!(
        list["templates"].as_array().map(Vec::len),
        Some(4),
        "{list}"
    );
    assert!(
        !list.to_string().contains(&token),
        "GET /templates holds the token"
    );
    assert!(!server.log().contains(&token), "serve.log holds the token");
    assert_no_secret("GET /templates", list.to_string().as_bytes());
    assert_no_secret("serve.log", server.log().as_bytes());
    let mut files = Vec::new();
    files_under(&server.state(), &mut files);
    assert!(
        files.iter().any(|(path, _)| path.ends_with("state.db")),
        "no state.db among {:?}",
        files.iter().map(|(p, _)| p).collect::<Vec<_>>()
    );
    for (path, bytes) in &files {
        assert_no_secret(&path.display().to_string(), bytes);
        assert!(
            !bytes.windows(token.len()).any(|w| w == token.as_bytes()),
            "{} holds the token",
            path.display()
        );
    }
}
