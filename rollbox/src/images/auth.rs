//! Registry credentials: a user and password (basic auth, which oci-client also trades for a
//! bearer token when the registry's challenge names a token realm) or a registry token, given
//! per build or read from a Docker `config.json`-format file (`--registry-auth FILE`).
//!
//! Only inline credentials are read: `auths.REGISTRY.auth` (base64 of `user:password`), or
//! `username` and `password`, or `registrytoken`. Credential helpers (`credsStore`,
//! `credHelpers`) are not run. Keys match the reference's registry (`host[:port]`), also as
//! Docker writes them (`https://host`, `https://host/v1/`; Docker Hub's
//! `https://index.docker.io/v1/` is `docker.io`). Secrets never appear in `Debug` output.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use base64::Engine as _;
use oci_client::secrets::RegistryAuth;
use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("cannot read registry credentials {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("registry credentials {path}: not a Docker config.json: {reason}")]
    Json { path: String, reason: String },
    #[error("registry credentials {path}: auths[{key:?}].auth is not base64: {reason}")]
    Base64 {
        path: String,
        key: String,
        reason: String,
    },
    #[error("registry credentials {path}: auths[{key:?}].auth does not decode to USER:PASSWORD (UTF-8, with a colon)")]
    NoColon { path: String, key: String },
    #[error("registry credentials {path}: auths[{key:?}] has a username without a password, or a password without a username")]
    HalfPair { path: String, key: String },
    #[error("registry credentials {path}: auths[{key:?}] for {registry} holds no inline credentials (auth, username and password, or registrytoken){helper}")]
    NoInline {
        path: String,
        key: String,
        registry: String,
        helper: String,
    },
    #[error("registry credentials {path}: auths[{key:?}] for {registry} has an identitytoken (an OAuth refresh token), which rollbox cannot use; give auth or username and password")]
    IdentityToken {
        path: String,
        key: String,
        registry: String,
    },
}

/// Credentials for one registry.
#[derive(Clone, PartialEq, Eq)]
pub enum Credentials {
    /// Basic auth, or the user and password a token server checks.
    Basic { username: String, password: String },
    /// A registry (bearer) token, sent as is.
    Token(String),
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Credentials::Basic { username, .. } => f
                .debug_struct("Basic")
                .field("username", username)
                .field("password", &"<redacted>")
                .finish(),
            Credentials::Token(_) => f.debug_tuple("Token").field(&"<redacted>").finish(),
        }
    }
}

impl Credentials {
    pub fn registry_auth(&self) -> RegistryAuth {
        match self {
            Credentials::Basic { username, password } => {
                RegistryAuth::Basic(username.clone(), password.clone())
            }
            Credentials::Token(token) => RegistryAuth::Bearer(token.clone()),
        }
    }

    /// Who the credentials are, for error messages: the user name, or "a token".
    pub fn describe(&self) -> String {
        match self {
            Credentials::Basic { username, .. } => format!("user {username:?}"),
            Credentials::Token(_) => "a registry token".to_string(),
        }
    }
}

/// What a pull authenticates with.
#[derive(Debug, Clone, Default)]
pub enum Auth {
    #[default]
    Anonymous,
    /// These credentials, whatever the registry.
    Given(Credentials),
    /// The entry of a credentials file for the reference's registry, if it has one.
    File(std::sync::Arc<AuthFile>),
}

impl Auth {
    /// The credentials for `registry` (`host[:port]` of a reference): None is anonymous.
    pub fn for_registry(&self, registry: &str) -> Result<Option<Credentials>, AuthError> {
        match self {
            Auth::Anonymous => Ok(None),
            Auth::Given(credentials) => Ok(Some(credentials.clone())),
            Auth::File(file) => file.for_registry(registry),
        }
    }
}

/// One `auths` entry, checked.
#[derive(Clone)]
enum Entry {
    Found(Credentials),
    /// An empty entry (its secret lies in a credential helper).
    NoInline,
    IdentityToken,
}

/// A Docker `config.json`-format credentials file, parsed.
#[derive(Clone)]
pub struct AuthFile {
    /// Where it was read from, for messages.
    path: String,
    /// `(key as written, registry it names, entry)`, in key order.
    entries: Vec<(String, String, Entry)>,
    /// `credsStore` or `credHelpers` is set: named when an entry holds nothing.
    helper: bool,
}

impl fmt::Debug for AuthFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let keys: Vec<&str> = self.entries.iter().map(|(k, _, _)| k.as_str()).collect();
        f.debug_struct("AuthFile")
            .field("path", &self.path)
            .field("registries", &keys)
            .finish()
    }
}

#[derive(Deserialize)]
struct ConfigJson {
    #[serde(default)]
    auths: BTreeMap<String, EntryJson>,
    #[serde(default, rename = "credsStore")]
    creds_store: Option<String>,
    #[serde(default, rename = "credHelpers")]
    cred_helpers: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct EntryJson {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    registrytoken: Option<String>,
    #[serde(default)]
    identitytoken: Option<String>,
}

/// The registry a config key or a reference's registry names: scheme, path and case dropped,
/// Docker Hub's names as `docker.io`.
pub fn normalize_registry(key: &str) -> String {
    let rest = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let host = rest.split('/').next().unwrap_or(rest).to_ascii_lowercase();
    match host.as_str() {
        "index.docker.io" | "registry-1.docker.io" | "registry.hub.docker.com" => {
            "docker.io".to_string()
        }
        _ => host,
    }
}

impl AuthFile {
    pub fn load(path: &Path) -> Result<AuthFile, AuthError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| AuthError::Read {
            path: shown.clone(),
            source,
        })?;
        AuthFile::parse(&text, &shown)
    }

    /// Parses a file's text; `path` only names it in errors.
    pub fn parse(text: &str, path: &str) -> Result<AuthFile, AuthError> {
        let config: ConfigJson = serde_json::from_str(text).map_err(|e| AuthError::Json {
            path: path.to_string(),
            reason: e.to_string(),
        })?;
        let mut entries = Vec::with_capacity(config.auths.len());
        for (key, json) in config.auths {
            let entry = entry_of(path, &key, json)?;
            let registry = normalize_registry(&key);
            entries.push((key, registry, entry));
        }
        Ok(AuthFile {
            path: path.to_string(),
            entries,
            helper: config.creds_store.is_some() || !config.cred_helpers.is_empty(),
        })
    }

    /// The credentials for `registry`: a key written exactly so first, else the first key
    /// that names the same registry; None when no key does.
    pub fn for_registry(&self, registry: &str) -> Result<Option<Credentials>, AuthError> {
        let wanted = normalize_registry(registry);
        let found = self
            .entries
            .iter()
            .find(|(key, _, _)| key == registry)
            .or_else(|| self.entries.iter().find(|(_, r, _)| *r == wanted));
        let Some((key, _, entry)) = found else {
            return Ok(None);
        };
        match entry {
            Entry::Found(credentials) => Ok(Some(credentials.clone())),
            Entry::NoInline => Err(AuthError::NoInline {
                path: self.path.clone(),
                key: key.clone(),
                registry: registry.to_string(),
                helper: if self.helper {
                    "; the file names a credential helper (credsStore/credHelpers), which rollbox does not run".to_string()
                } else {
                    String::new()
                },
            }),
            Entry::IdentityToken => Err(AuthError::IdentityToken {
                path: self.path.clone(),
                key: key.clone(),
                registry: registry.to_string(),
            }),
        }
    }
}

/// One entry: `auth` wins over `username`/`password` (as in Docker), then `registrytoken`.
fn entry_of(path: &str, key: &str, json: EntryJson) -> Result<Entry, AuthError> {
    if let Some(encoded) = json.auth.filter(|a| !a.is_empty()) {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .map_err(|e| AuthError::Base64 {
                path: path.to_string(),
                key: key.to_string(),
                reason: e.to_string(),
            })?;
        let no_colon = || AuthError::NoColon {
            path: path.to_string(),
            key: key.to_string(),
        };
        let text = String::from_utf8(decoded).map_err(|_| no_colon())?;
        let (username, password) = text.split_once(':').ok_or_else(no_colon)?;
        return Ok(Entry::Found(Credentials::Basic {
            username: username.to_string(),
            password: password.to_string(),
        }));
    }
    let username = json.username.filter(|u| !u.is_empty());
    let password = json.password.filter(|p| !p.is_empty());
    match (username, password) {
        (Some(username), Some(password)) => {
            return Ok(Entry::Found(Credentials::Basic { username, password }))
        }
        (None, None) => {}
        _ => {
            return Err(AuthError::HalfPair {
                path: path.to_string(),
                key: key.to_string(),
            })
        }
    }
    if let Some(token) = json.registrytoken.filter(|t| !t.is_empty()) {
        return Ok(Entry::Found(Credentials::Token(token)));
    }
    if json.identitytoken.is_some_and(|t| !t.is_empty()) {
        return Ok(Entry::IdentityToken);
    }
    Ok(Entry::NoInline)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b64(text: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(text)
    }

    fn basic(username: &str, password: &str) -> Option<Credentials> {
        Some(Credentials::Basic {
            username: username.to_string(),
            password: password.to_string(),
        })
    }

    #[test]
    fn finds_the_entry_of_a_registry_in_each_key_form() {
        let text = format!(
            r#"{{"auths": {{
                "127.0.0.1:5001": {{"auth": "{}"}},
                "https://ghcr.io": {{"username": "gh", "password": "pw:with:colons"}},
                "https://index.docker.io/v1/": {{"auth": "{}"}},
                "http://Registry.Example:8443/v1/": {{"registrytoken": "tok"}}
            }}, "HttpHeaders": {{"User-Agent": "x"}}}}"#,
            b64("alice:s3cret"),
            b64("hub:hubpw")
        );
        let file = AuthFile::parse(&text, "config.json").expect("parse");
        assert_eq!(
            file.for_registry("127.0.0.1:5001").unwrap(),
            basic("alice", "s3cret")
        );
        assert_eq!(
            file.for_registry("ghcr.io").unwrap(),
            basic("gh", "pw:with:colons")
        );
        assert_eq!(
            file.for_registry("docker.io").unwrap(),
            basic("hub", "hubpw")
        );
        assert_eq!(
            file.for_registry("index.docker.io").unwrap(),
            basic("hub", "hubpw")
        );
        assert_eq!(
            file.for_registry("registry.example:8443").unwrap(),
            Some(Credentials::Token("tok".to_string()))
        );
    }

    #[test]
    fn an_unknown_registry_is_anonymous() {
        let text = format!(
            r#"{{"auths": {{"127.0.0.1:5001": {{"auth": "{}"}}}}}}"#,
            b64("a:b")
        );
        let file = AuthFile::parse(&text, "c.json").expect("parse");
        for other in ["127.0.0.1:5002", "127.0.0.1", "docker.io", "ghcr.io"] {
            assert_eq!(file.for_registry(other).unwrap(), None, "{other}");
        }
        let empty = AuthFile::parse("{}", "c.json").expect("an empty config");
        assert_eq!(empty.for_registry("ghcr.io").unwrap(), None);
        assert_eq!(Auth::Anonymous.for_registry("ghcr.io").unwrap(), None);
    }

    #[test]
    fn an_exact_key_wins_over_a_normalized_one() {
        let text = format!(
            r#"{{"auths": {{"https://ghcr.io/v1/": {{"auth": "{}"}}, "ghcr.io": {{"auth": "{}"}}}}}}"#,
            b64("old:1"),
            b64("new:2")
        );
        let file = AuthFile::parse(&text, "c.json").expect("parse");
        assert_eq!(file.for_registry("ghcr.io").unwrap(), basic("new", "2"));
    }

    #[test]
    fn auth_wins_over_username_and_password() {
        let text = format!(
            r#"{{"auths": {{"r.io": {{"auth": "{}", "username": "u", "password": "p"}}}}}}"#,
            b64("a:b")
        );
        let file = AuthFile::parse(&text, "c.json").expect("parse");
        assert_eq!(file.for_registry("r.io").unwrap(), basic("a", "b"));
    }

    #[test]
    fn bad_entries_are_named() {
        let cases = [
            (
                r#"{"auths": {"r.io": {"auth": "!!not base64"}}}"#.to_string(),
                "not base64",
            ),
            (
                format!(
                    r#"{{"auths": {{"r.io": {{"auth": "{}"}}}}}}"#,
                    b64("nocolon")
                ),
                "USER:PASSWORD",
            ),
            (
                r#"{"auths": {"r.io": {"username": "u"}}}"#.to_string(),
                "without a password",
            ),
            (
                r#"{"auths": ["r.io"]}"#.to_string(),
                "not a Docker config.json",
            ),
            ("not json".to_string(), "not a Docker config.json"),
        ];
        for (text, expected) in cases {
            let err = AuthFile::parse(&text, "/etc/x.json").expect_err(&text);
            let message = err.to_string();
            assert!(message.contains(expected), "{text}: {message}");
            assert!(message.contains("/etc/x.json"), "{message}");
        }
    }

    #[test]
    fn helper_and_identity_token_entries_say_why_they_cannot_be_used() {
        let text = r#"{"auths": {"https://index.docker.io/v1/": {}, "acr.io": {"identitytoken": "t"}},
                       "credsStore": "desktop"}"#;
        let file = AuthFile::parse(text, "c.json").expect("parse");
        let helper = file
            .for_registry("docker.io")
            .expect_err("no inline")
            .to_string();
        assert!(helper.contains("credential helper"), "{helper}");
        let identity = file
            .for_registry("acr.io")
            .expect_err("identity")
            .to_string();
        assert!(identity.contains("identitytoken"), "{identity}");
        // A registry with no entry at all is still anonymous.
        assert_eq!(file.for_registry("ghcr.io").unwrap(), None);
    }

    #[test]
    fn a_missing_file_is_named() {
        let err = AuthFile::load(Path::new("/nonexistent/config.json")).expect_err("missing");
        assert!(
            err.to_string().contains("/nonexistent/config.json"),
            "{err}"
        );
    }

    #[test]
    fn debug_output_hides_secrets() {
        let text = format!(
            r#"{{"auths": {{"r.io": {{"auth": "{}"}}}}}}"#,
            b64("u:hunter2")
        );
        let file = AuthFile::parse(&text, "c.json").expect("parse");
        let auth = Auth::File(std::sync::Arc::new(file));
        let shown = format!(
            "{auth:?} {:?} {:?}",
            basic("u", "hunter2"),
            Credentials::Token("tok-hunter2".into())
        );
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("r.io"), "{shown}");
    }
}
