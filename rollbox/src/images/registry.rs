//! Pulling from an OCI distribution registry with `oci-client`. Plain HTTP is used for
//! loopback registries (and any registry with `--insecure`). Credentials ([`Auth`]) are sent
//! as basic auth, or traded by oci-client for a bearer token at the realm the registry's
//! `WWW-Authenticate` challenge names; a refusal is [`RegistryError::Auth`].

use std::fs::File;
use std::io::Write;
use std::net::IpAddr;
use std::time::Duration;

use futures_util::StreamExt as _;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::RegistryOperation;
use oci_client::{Client, Reference};

use super::auth::{Auth, AuthError};
use super::cache::{Cache, CacheError};
use super::digest::{Digest, DigestError};
use super::progress::Progress;
use super::source::{BlobLocation, LayerBlob, ResolvedImage, SourceKind};
use super::spec::ImageConfigFile;

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("invalid image reference {reference:?}: {reason}")]
    BadReference { reference: String, reason: String },
    #[error("image {reference} not found in registry {registry}: {detail}")]
    NotFound {
        reference: String,
        registry: String,
        detail: String,
    },
    #[error("cannot reach registry {registry} for {reference}: {detail}")]
    Unreachable {
        reference: String,
        registry: String,
        detail: String,
    },
    #[error("registry {registry} refused the credentials for {reference}: {detail}")]
    Auth {
        reference: String,
        registry: String,
        detail: String,
    },
    #[error("registry {registry} refused anonymous access to {reference} (give credentials: --registry-auth FILE, or a request's image.auth; some registries answer so for an image that does not exist, too): {detail}")]
    NeedsAuth {
        reference: String,
        registry: String,
        detail: String,
    },
    #[error(transparent)]
    Credentials(#[from] AuthError),
    #[error("pulling {reference} from {registry} failed: {detail}")]
    Pull {
        reference: String,
        registry: String,
        detail: String,
    },
    #[error("registry {registry}: image {reference} has an invalid {what}: {reason}")]
    Invalid {
        reference: String,
        registry: String,
        what: String,
        reason: String,
    },
    #[error("registry {registry}: blob {digest} of {reference} does not match its digest (got {actual})")]
    BlobDigest {
        reference: String,
        registry: String,
        digest: String,
        actual: String,
    },
    #[error("cannot write blob {digest} into the cache at {path}: {source}")]
    WriteBlob {
        digest: String,
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
}

/// A connection to one image's registry.
pub struct RegistrySession {
    runtime: tokio::runtime::Runtime,
    client: Client,
    reference: Reference,
    registry: String,
    auth: RegistryAuth,
    /// Who `auth` is, for errors: None when anonymous.
    who: Option<String>,
}

/// `localhost`, `127.x.x.x` or `[::1]`, with or without a port.
pub fn is_loopback(registry: &str) -> bool {
    let host = if let Some(rest) = registry.strip_prefix('[') {
        rest.split(']').next().unwrap_or(rest)
    } else {
        registry.rsplit_once(':').map_or(registry, |(host, _)| host)
    };
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The error text with all its causes (reqwest hides "connection refused" in a source).
fn full_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

impl RegistrySession {
    /// A session for `reference`, with the credentials `auth` has for its registry.
    pub fn connect(reference: &str, insecure: bool, auth: &Auth) -> Result<Self, RegistryError> {
        let parsed: Reference =
            reference
                .parse()
                .map_err(|e: oci_client::ParseError| RegistryError::BadReference {
                    reference: reference.to_string(),
                    reason: e.to_string(),
                })?;
        // Only the first call installs the provider; later ones fail harmlessly.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let registry = parsed.registry().to_string();
        let credentials = auth.for_registry(&registry)?;
        let who = credentials.as_ref().map(|c| c.describe());
        let auth = credentials.map_or(RegistryAuth::Anonymous, |c| c.registry_auth());
        let protocol = if insecure || is_loopback(&registry) {
            ClientProtocol::HttpsExcept(vec![
                registry.clone(),
                parsed.resolve_registry().to_string(),
            ])
        } else {
            ClientProtocol::Https
        };
        let config = ClientConfig {
            protocol,
            connect_timeout: Some(Duration::from_secs(10)),
            read_timeout: Some(Duration::from_secs(120)),
            ..Default::default()
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(RegistryError::Runtime)?;
        Ok(Self {
            runtime,
            client: Client::new(config),
            reference: parsed,
            registry,
            auth,
            who,
        })
    }

    fn classify(&self, error: OciDistributionError) -> RegistryError {
        let reference = self.reference.whole();
        let registry = self.registry.clone();
        let detail = full_chain(&error);
        let not_found = match &error {
            OciDistributionError::ImageManifestNotFoundError(_) => true,
            OciDistributionError::RegistryError { envelope, .. } => {
                envelope.errors.iter().any(|e| {
                    matches!(
                        e.code,
                        OciErrorCode::ManifestUnknown
                            | OciErrorCode::NameUnknown
                            | OciErrorCode::NotFound
                            | OciErrorCode::BlobUnknown
                    )
                })
            }
            OciDistributionError::ServerError { code, .. } => *code == 404,
            _ => false,
        };
        let refused = match &error {
            OciDistributionError::UnauthorizedError { .. }
            | OciDistributionError::AuthenticationFailure(_) => true,
            OciDistributionError::RegistryError { envelope, .. } => envelope
                .errors
                .iter()
                .any(|e| matches!(e.code, OciErrorCode::Unauthorized | OciErrorCode::Denied)),
            OciDistributionError::ServerError { code, .. } => matches!(*code, 401 | 403),
            _ => false,
        };
        if refused {
            match &self.who {
                Some(who) => RegistryError::Auth {
                    reference,
                    registry,
                    detail: format!("{who}: {detail}"),
                },
                None => RegistryError::NeedsAuth {
                    reference,
                    registry,
                    detail,
                },
            }
        } else if not_found {
            RegistryError::NotFound {
                reference,
                registry,
                detail,
            }
        } else if matches!(&error, OciDistributionError::RequestError(e) if e.is_connect() || e.is_timeout())
        {
            RegistryError::Unreachable {
                reference,
                registry,
                detail,
            }
        } else {
            RegistryError::Pull {
                reference,
                registry,
                detail,
            }
        }
    }

    /// Fetches the manifest (resolving a multi-platform index) and the config. The config
    /// blob is checked against its digest by oci-client.
    pub fn resolve(&self) -> Result<ResolvedImage, RegistryError> {
        let invalid = |what: &str, reason: String| RegistryError::Invalid {
            reference: self.reference.whole(),
            registry: self.registry.clone(),
            what: what.to_string(),
            reason,
        };
        if self.auth != RegistryAuth::Anonymous {
            // Done apart so that a token server's refusal is the error: a pull would drop it
            // and go on anonymously.
            self.runtime
                .block_on(
                    self.client
                        .auth(&self.reference, &self.auth, RegistryOperation::Pull),
                )
                .map_err(|e| self.classify(e))?;
        }
        let (manifest, manifest_digest, config_json, _list_digest) = self
            .runtime
            .block_on(
                self.client
                    .pull_manifest_and_config_and_list_digest(&self.reference, &self.auth),
            )
            .map_err(|e| self.classify(e))?;
        let parse = |what: &str, value: &str| {
            Digest::parse(value).map_err(|e: DigestError| invalid(what, e.to_string()))
        };
        let manifest_digest = parse("manifest digest", &manifest_digest)?;
        let config_digest = parse("config digest", &manifest.config.digest)?;
        let config: ImageConfigFile = serde_json::from_str(&config_json)
            .map_err(|e| invalid("image config", e.to_string()))?;
        let diff_ids = config
            .rootfs
            .as_ref()
            .map(|r| r.diff_ids.clone())
            .unwrap_or_default();
        let mut layers = Vec::with_capacity(manifest.layers.len());
        for (i, layer) in manifest.layers.iter().enumerate() {
            layers.push(LayerBlob {
                digest: Some(parse("layer digest", &layer.digest)?),
                diff_id: diff_ids
                    .get(i)
                    .map(|d| parse("layer diff_id", d))
                    .transpose()?,
                size: u64::try_from(layer.size).unwrap_or(0),
                location: BlobLocation::Remote,
            });
        }
        Ok(ResolvedImage {
            kind: SourceKind::Registry,
            name: self.reference.whole(),
            image_digest: manifest_digest.clone(),
            manifest_digest: Some(manifest_digest),
            config_digest,
            config,
            layers,
        })
    }

    /// Downloads every layer not yet in the cache into `blobs/sha256/`, checking each digest.
    pub fn fetch_layers(
        &self,
        image: &mut ResolvedImage,
        cache: &Cache,
        progress: Progress,
    ) -> Result<(), RegistryError> {
        let count = image.layers.len();
        for (i, layer) in image.layers.iter_mut().enumerate() {
            let Some(digest) = layer.digest.clone() else {
                continue;
            };
            let cached = cache.blob_path(&digest);
            if !cached.is_file() {
                let bar = progress.bytes(
                    layer.size,
                    format!("pull {}/{count} {}", i + 1, digest.short()),
                );
                let result = self.download(&digest, layer.size, cache, &bar);
                bar.finish_and_clear();
                result?;
            }
            layer.location = BlobLocation::File(cached);
        }
        Ok(())
    }

    fn download(
        &self,
        digest: &Digest,
        size: u64,
        cache: &Cache,
        bar: &indicatif::ProgressBar,
    ) -> Result<(), RegistryError> {
        let staging = cache.staging("blob");
        let write_error = |source| RegistryError::WriteBlob {
            digest: digest.to_string(),
            path: staging.path().display().to_string(),
            source,
        };
        let mut file = File::create(staging.path()).map_err(write_error)?;
        let descriptor = OciDescriptor {
            digest: digest.to_string(),
            size: i64::try_from(size).unwrap_or(0),
            ..Default::default()
        };
        let actual = self.runtime.block_on(async {
            let mut stream = self
                .client
                .pull_blob_stream(&self.reference, &descriptor)
                .await
                .map_err(|e| self.classify(e))?;
            let mut hasher = Sha256Stream::default();
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| RegistryError::Pull {
                    reference: self.reference.whole(),
                    registry: self.registry.clone(),
                    detail: format!("reading blob {digest}: {}", full_chain(&e)),
                })?;
                hasher.update(&chunk);
                file.write_all(&chunk).map_err(write_error)?;
                bar.inc(chunk.len() as u64);
            }
            Ok::<Digest, RegistryError>(hasher.finish())
        })?;
        file.sync_all().map_err(write_error)?;
        drop(file);
        if &actual != digest {
            return Err(RegistryError::BlobDigest {
                reference: self.reference.whole(),
                registry: self.registry.clone(),
                digest: digest.to_string(),
                actual: actual.to_string(),
            });
        }
        cache.commit_blob(staging, digest)?;
        Ok(())
    }
}

#[derive(Default)]
struct Sha256Stream {
    hasher: sha2::Sha256,
}

impl Sha256Stream {
    fn update(&mut self, bytes: &[u8]) {
        sha2::Digest::update(&mut self.hasher, bytes);
    }

    fn finish(self) -> Digest {
        let hex = super::digest::to_hex(&sha2::Digest::finalize(self.hasher));
        // A sha256 rendered as 64 hex digits always parses.
        Digest::parse(&format!("sha256:{hex}")).unwrap_or_else(|_| Digest::of_bytes(b""))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_detection() {
        for yes in [
            "127.0.0.1:5000",
            "localhost:5000",
            "localhost",
            "[::1]:5000",
            "127.1.2.3",
        ] {
            assert!(is_loopback(yes), "{yes}");
        }
        for no in [
            "docker.io",
            "index.docker.io",
            "10.0.0.1:5000",
            "registry.example:443",
        ] {
            assert!(!is_loopback(no), "{no}");
        }
    }

    #[test]
    fn bad_reference_is_named() {
        let err = RegistrySession::connect("bad ref/with space:tag", false, &Auth::Anonymous)
            .err()
            .unwrap();
        assert!(err.to_string().contains("bad ref/with space:tag"), "{err}");
    }

    #[test]
    fn closed_port_is_unreachable() {
        // Port 9 (discard) on loopback: nothing listens there on these machines.
        let session =
            RegistrySession::connect("127.0.0.1:9/none:latest", false, &Auth::Anonymous).unwrap();
        match session.resolve() {
            Err(RegistryError::Unreachable { registry, .. }) => assert_eq!(registry, "127.0.0.1:9"),
            Err(other) => panic!("expected unreachable, got {other}"),
            Ok(_) => panic!("expected an error"),
        }
    }
}
