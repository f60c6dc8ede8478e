//! The layer and its configuration.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode, header};
use tower_layer::Layer;
use tracing::Level;

use crate::config::{Config, Counters, ScopeRule};
use crate::events::Event;
use crate::fingerprint::Fingerprint;
use crate::front::consumer::{Consume, ConsumerLayer, MESSAGE_ID};
#[cfg(feature = "grpc")]
use crate::front::grpc::{Grpc as GrpcFront, GrpcIdempotencyLayer, GuardedMethod};
use crate::front::http::{Http, Idempotent};
use crate::key::KeySource;
use crate::store::Store;

/// The layer: wraps a service so that each (scope, key) runs it once.
///
/// Cheap to clone; every clone shares one configuration and one set of [`Counters`].
pub struct IdempotencyLayer<S> {
    pub(crate) config: Arc<Config<S>>,
}

impl<S> Clone for IdempotencyLayer<S> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            config: self.config.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyLayer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("IdempotencyLayer")
            .field("store", &c.store)
            .field("methods", &c.methods)
            .field("key", &c.key)
            .field("require_key", &c.require_key)
            .field("lease", &c.lease)
            .field("retention", &c.retention)
            .field("max_attempts", &c.max_attempts)
            .field("failed_retention", &c.failed_retention)
            .field("shared_scope", &c.scope.is_shared())
            .field("not_stored", &c.not_stored)
            .field("saved_headers", &c.saved_headers)
            .field("request_body_timeout", &c.request_body_timeout)
            .finish_non_exhaustive()
    }
}

impl<S: Store> IdempotencyLayer<S> {
    /// Starts a layer on `store` with the defaults each setter states.
    pub fn builder(store: S) -> Builder<S> {
        Builder {
            config: Config {
                store,
                methods: vec![Method::POST, Method::PATCH],
                key: KeySource::default(),
                require_key: true,
                scope: ScopeRule::Unset,
                lease: Duration::from_secs(30),
                in_progress_retry_after: Duration::from_secs(1),
                fenced_wait: Duration::from_secs(5),
                retention: Duration::from_secs(24 * 60 * 60),
                max_request_body: 1 << 20,
                max_answer_body: 1 << 20,
                max_key_len: 255,
                fingerprint: Fingerprint::default(),
                max_attempts: 10,
                failed_retention: Duration::from_secs(7 * 24 * 60 * 60),
                not_stored: Vec::new(),
                saved_headers: DEFAULT_SAVED_HEADERS.into(),
                request_body_timeout: Duration::from_secs(10),
                events: Arc::default(),
                counters: Arc::default(),
                front: Arc::new(Http::default()),
            },
            key_chosen: false,
            #[cfg(feature = "grpc")]
            grpc: Grpc::default(),
        }
    }

    /// The layer's counters, shared by every clone of it and of its services.
    pub fn counters(&self) -> &Arc<Counters> {
        &self.config.counters
    }

    /// The store the layer keeps its outcomes in.
    pub fn store(&self) -> &S {
        &self.config.store
    }
}

impl<S, Svc> Layer<Svc> for IdempotencyLayer<S> {
    type Service = Idempotent<Svc, S>;

    fn layer(&self, inner: Svc) -> Idempotent<Svc, S> {
        Idempotent {
            inner,
            config: self.config.clone(),
        }
    }
}

/// Sets up an [`IdempotencyLayer`]. Every setter states its default; [`build`](Builder::build)
/// refuses a configuration that cannot keep the layer's promises.
pub struct Builder<S> {
    config: Config<S>,
    /// Whether `key` chose the key's source: the consumer layer reads the message id otherwise.
    key_chosen: bool,
    #[cfg(feature = "grpc")]
    grpc: Grpc,
}

/// What a builder knows of the gRPC front.
#[cfg(feature = "grpc")]
#[derive(Default)]
struct Grpc {
    methods: Vec<GuardedMethod>,
    not_stored: Vec<tonic::Code>,
}

impl<S: fmt::Debug> fmt::Debug for Builder<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Builder")
            .field("store", &self.config.store)
            .finish_non_exhaustive()
    }
}

impl<S: Store> Builder<S> {
    /// The methods the layer guards [POST, PATCH]. Requests with other methods pass through
    /// untouched (GET, PUT and DELETE are idempotent by their own meaning).
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// Where the key comes from [`KeySource::idempotency_key(KeyForm::Either)`]: the
    /// `Idempotency-Key` header, quoted or bare (for a consumer layer: the message's id).
    ///
    /// [`KeySource::idempotency_key(KeyForm::Either)`]: KeySource::idempotency_key
    pub fn key(mut self, source: KeySource) -> Self {
        self.config.key = source;
        self.key_chosen = true;
        self
    }

    /// Whether a request without a key is refused with `400` [true]. When false it passes
    /// through to the handler with no record kept: it may run more than once.
    pub fn require_key(mut self, required: bool) -> Self {
        self.config.require_key = required;
        self
    }

    /// The caller's scope, from the request's head: keys are unique per scope. Every builder
    /// chooses a scope on purpose, this or [`shared_scope`](Builder::shared_scope); `build`
    /// refuses one that chose neither.
    ///
    /// Scope keys by the authenticated principal, e.g. one an auth layer put in the
    /// extensions: `.scope(|parts| parts.extensions.get::<Principal>().map(|p| p.id.clone()))`.
    /// A request the function returns `None` for is answered `401`, and nothing runs.
    pub fn scope(
        mut self,
        scope: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.config.scope = ScopeRule::By(Arc::new(scope));
        self
    }

    /// One scope for every caller: two callers that send the same key share one record, and
    /// the second gets the first's stored answer (or a `422`). For a service with one caller,
    /// or keys no two callers can share (a webhook's event ids). A replay under the shared
    /// scope never carries the first caller's `Set-Cookie`.
    pub fn shared_scope(mut self) -> Self {
        self.config.scope = ScopeRule::Shared;
        self
    }

    /// Statuses of the handler's answers that are not outcomes and are never stored \[none\]:
    /// such an answer reaches its caller, the handler's transaction rolls back, and the lease
    /// ends at once, so a retry with the key runs the handler again. For answers a framework
    /// makes before the handler (axum's `415` or `400` for a body its extractor refuses) or a
    /// proxy's own; a `5xx` the handler chose after it began is an outcome and is stored.
    /// The layer's own failures (the store, its pool) and the crate's `LocalError`,
    /// `StoreError` and `StepError` answers are never stored, whatever this says.
    pub fn not_stored(mut self, statuses: impl IntoIterator<Item = StatusCode>) -> Self {
        self.config.not_stored = statuses.into_iter().collect();
        self
    }

    /// The request headers a record saves for a resumption (the reconciler runs the request
    /// again from them) [`content-type`, `content-encoding`, `content-language`, `accept`,
    /// `accept-language`, `idempotency-key`]. The saved request is cleared when its record
    /// completes or fails. Credentials are never saved: `build` refuses an allow-list that
    /// names `authorization`, `proxy-authorization`, `cookie` or a name that reads as a secret
    /// (`…token…`, `…secret…`, `…password…`, `…api-key…`, `…apikey…`, `…session…`).
    pub fn saved_headers(mut self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config.saved_headers = names.into_iter().collect::<Vec<_>>().into();
        self
    }

    /// How long the layer waits for a guarded request's body to arrive whole [10 s]; a body
    /// still arriving then is answered `408 body-timeout` and nothing is stored, so a client
    /// that never ends its body holds no memory past it.
    pub fn request_body_timeout(mut self, timeout: Duration) -> Self {
        self.config.request_body_timeout = timeout;
        self
    }

    /// The level `event` is logged at by this layer and its reconciler (see [`Event`] for
    /// each one's default; a `Relay` and a [`Sweeper`](crate::Sweeper), built apart from the
    /// layer, log at the defaults). For example, `.event_level(Event::Replay, Level::DEBUG)`
    /// quiets replays.
    pub fn event_level(mut self, event: Event, level: Level) -> Self {
        Arc::make_mut(&mut self.config.events).set(event, level);
        self
    }

    /// How long a holder may run before another request with the key may take its record over
    /// [30 s]. Keep it above the handler's longest run: a holder still working when its lease
    /// ends loses its completion to the takeover (its transaction rolls back).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }

    /// The retry hint of a `409` for a key whose first request is still running [1 s]:
    /// `Retry-After` in whole seconds rounded up, and `retry-after-ms` with the milliseconds
    /// (which this workspace's client reads first). It is a hint of when the first will have finished, so keep
    /// it near the handler's usual run, not the lease: a client that is told to wait longer
    /// than its own deadline allows gives up (this workspace's client does).
    pub fn in_progress_retry_after(mut self, after: Duration) -> Self {
        self.config.in_progress_retry_after = after;
        self
    }

    /// How long a holder that another attempt took over waits for that attempt's outcome
    /// before it answers [5 s]. A holder stalled past its lease (a paused process, a slow
    /// call) finds, when it writes its next recovery point or its answer, that a retry with its
    /// key took the record over: it wrote nothing, and its caller is still waiting. It answers
    /// the other attempt's stored outcome once there is one within this wait, and otherwise
    /// `503 taken-over` with the [`in_progress_retry_after`](Builder::in_progress_retry_after)
    /// hint, which every client retries with the same key; never `409`, which would tell the
    /// first request with a key that it is its own rival. Zero answers at once.
    pub fn fenced_wait(mut self, wait: Duration) -> Self {
        self.config.fenced_wait = wait;
        self
    }

    /// How long a key's record, and so its stored answer, is kept [24 h]: within it every
    /// request with the key gets the one outcome; after it (and the [`sweep`](crate::store::Outcomes::sweep))
    /// the key is new again. This is the API's contract with its clients: state it in your API
    /// docs.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.config.retention = retention;
        self
    }

    /// The largest request body the layer reads for the fingerprint [1 MiB]; a larger one is
    /// answered `413` and nothing is stored.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config.max_request_body = bytes;
        self
    }

    /// The largest answer body the layer stores [1 MiB]. A larger answer still reaches the
    /// first caller whole, streamed; its status is stored without its body, and a replay gets
    /// that status with an `answer-not-stored` problem, so a retry learns the outcome happened
    /// and never runs it again.
    pub fn max_answer_body(mut self, bytes: usize) -> Self {
        self.config.max_answer_body = bytes;
        self
    }

    /// The longest key [255 bytes].
    pub fn max_key_len(mut self, bytes: usize) -> Self {
        self.config.max_key_len = bytes;
        self
    }

    /// What makes two requests the same [method, path and query, body bytes].
    pub fn fingerprint(mut self, fingerprint: Fingerprint) -> Self {
        self.config.fingerprint = fingerprint;
        self
    }

    /// How many times a record may be started \[10\]: its first run and each resumption (a
    /// retry's takeover, or the reconciler's) count one. A record started once more ends
    /// `failed` instead of running its handler again, and every later request with its key is
    /// sent a `500` `gave-up` problem: a dependency that never answers stops being called.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.config.max_attempts = attempts;
        self
    }

    /// How long a record that ended `failed` is kept [7 days], from when it failed: longer
    /// than an answer's [retention](Builder::retention), for an operator to look at its last
    /// recovery point.
    pub fn failed_retention(mut self, retention: Duration) -> Self {
        self.config.failed_retention = retention;
        self
    }

    /// Checks the configuration and builds the layer.
    pub fn build(self) -> Result<IdempotencyLayer<S>, ConfigError> {
        if self.config.methods.is_empty() {
            return Err(ConfigError("`methods` is empty: the layer would guard nothing; name at least one method (e.g. POST)".into()));
        }
        #[cfg(feature = "grpc")]
        if !self.grpc.methods.is_empty() {
            return Err(ConfigError("gRPC methods are named (`grpc_method`): build the gRPC layer with `build_grpc`, and the HTTP layer from a builder of its own".into()));
        }
        self.check()?;
        self.config.counters.announce();
        let mut config = self.config;
        config.front = Arc::new(Http {
            not_stored: config.not_stored.clone(),
        });
        Ok(IdempotencyLayer {
            config: Arc::new(config),
        })
    }

    /// The checks every layer's settings pass, whatever its transport.
    fn check(&self) -> Result<(), ConfigError> {
        let c = &self.config;
        if c.lease < Duration::from_millis(1) {
            return Err(ConfigError("`lease` is under 1 ms: every request would take over the one running; set it above the handler's longest run (default 30 s)".into()));
        }
        if c.retention <= c.lease {
            return Err(ConfigError(format!(
                "`retention` ({:?}) is not longer than `lease` ({:?}): an outcome would be forgotten while its request may still run; keep retention far longer (default 24 h)",
                c.retention, c.lease
            )));
        }
        if c.max_attempts == 0 {
            return Err(ConfigError(
                "`max_attempts` is 0: no request would ever run; allow at least 1 (default 10)"
                    .into(),
            ));
        }
        if matches!(c.scope, ScopeRule::Unset) {
            return Err(ConfigError("no scope chosen: call `.scope(|parts| ...)` to scope keys by the authenticated caller, or `.shared_scope()` for one scope every caller shares".into()));
        }
        if let Some(secret) = c.saved_headers.iter().find(|name| is_secret(name)) {
            return Err(ConfigError(format!(
                "`saved_headers` names `{secret}`, a credential: saved requests never keep credentials; take it out (the reconciler's handler reads the caller from `Execution::scope`)"
            )));
        }
        if c.request_body_timeout.is_zero() {
            return Err(ConfigError("`request_body_timeout` is zero: no body would ever be read; allow the slowest client's upload (default 10 s)".into()));
        }
        if c.max_key_len == 0 || c.max_key_len > 4096 {
            return Err(ConfigError(format!(
                "`max_key_len` is {}: set it between 1 and 4096 bytes (default 255)",
                c.max_key_len
            )));
        }
        if c.max_key_len > S::MAX_KEY_LEN {
            return Err(ConfigError(format!(
                "`max_key_len` is {}, but the store keeps keys of at most {} bytes: set it at most that (default 255)",
                c.max_key_len,
                S::MAX_KEY_LEN
            )));
        }
        Ok(())
    }
}

#[cfg(feature = "grpc")]
#[cfg_attr(docsrs, doc(cfg(feature = "grpc")))]
impl<S: Store> Builder<S> {
    /// A gRPC method the layer guards, by its path (`/package.Service/Method`, the leading
    /// `/` optional): each call must carry a key in its `idempotency-key` metadata (what this
    /// workspace's gRPC door sends for a method it is told is not idempotent), and runs once
    /// per (scope, key). Other methods pass through untouched. Name each method that makes an
    /// effect; a gRPC layer guards only the methods named.
    pub fn grpc_method(mut self, path: &str) -> Self {
        self.grpc.methods.push(GuardedMethod {
            path: guarded_path(path),
            key_required: true,
        });
        self
    }

    /// A gRPC method the layer guards when a call carries a key: a call without one runs as
    /// it would without the layer, with nothing recorded (it may run more than once).
    pub fn grpc_method_key_optional(mut self, path: &str) -> Self {
        self.grpc.methods.push(GuardedMethod {
            path: guarded_path(path),
            key_required: false,
        });
        self
    }

    /// Codes of a handler's trailers-only statuses that are not outcomes and are never stored
    /// \[none\]: the status reaches its caller, the handler's transaction rolls back and the
    /// lease ends at once, so a retry with the key runs the handler again (gRPC's own
    /// `RESOURCE_EXHAUSTED` from a concurrency limit, say). A status the handler chose after
    /// it began is an outcome and is stored; the statuses the crate makes of `StepError`,
    /// `LocalError` and `StoreError` are never stored, whatever this says. A status after
    /// messages (in trailers) is always an outcome: the call answered.
    pub fn grpc_not_stored(mut self, codes: impl IntoIterator<Item = tonic::Code>) -> Self {
        self.grpc.not_stored = codes.into_iter().collect();
        self
    }

    /// Checks the configuration and builds the layer for a tonic server (the `grpc_…`
    /// settings, and every setting of the HTTP layer but `methods`, `not_stored` and `key`'s
    /// body sources, which a call's metadata does not have).
    pub fn build_grpc(mut self) -> Result<GrpcIdempotencyLayer<S>, ConfigError> {
        let grpc = std::mem::take(&mut self.grpc);
        if grpc.methods.is_empty() {
            return Err(ConfigError("no gRPC method named: the layer would guard nothing; name each method that makes an effect with `.grpc_method(\"/package.Service/Method\")`".into()));
        }
        if let Some(bad) = grpc.methods.iter().find(|m| !is_grpc_path(&m.path)) {
            return Err(ConfigError(format!(
                "`{}` is not a gRPC method's path: write it as `/package.Service/Method`",
                bad.path
            )));
        }
        if self.config.key.needs_body() {
            return Err(ConfigError("the key source reads the body, which a gRPC call's messages are not: read the key from metadata (the default, `idempotency-key`, or `KeySource::header`)".into()));
        }
        self.check()?;
        self.config.counters.announce();
        let mut config = self.config;
        config.methods = vec![Method::POST];
        if config.saved_headers[..] == DEFAULT_SAVED_HEADERS[..] {
            // A resumed call needs its messages' encoding to decode them.
            let mut saved = DEFAULT_SAVED_HEADERS.to_vec();
            saved.extend([
                HeaderName::from_static("grpc-encoding"),
                HeaderName::from_static("grpc-accept-encoding"),
            ]);
            config.saved_headers = saved.into();
        }
        config.front = Arc::new(GrpcFront {
            not_stored: grpc.not_stored,
        });
        Ok(GrpcIdempotencyLayer {
            config: Arc::new(config),
            methods: grpc.methods.into(),
        })
    }
}

impl<S: Store> Builder<S> {
    /// Checks the configuration and builds the layer for message consumers: each message runs
    /// its handler once per (scope, message id). The key is the delivery's id unless
    /// [`key`](Builder::key) names another source (`KeySource::json_pointer("/id")` for an
    /// event id in the payload); a message without one goes to the dead letters. Every setting
    /// of the HTTP layer applies but `methods` and `require_key`; [`not_stored`](Builder::not_stored)
    /// names the handler's statuses that ask for a redelivery instead of an outcome, and
    /// [`in_progress_retry_after`](Builder::in_progress_retry_after) is the wait before a
    /// message is delivered again [1 s].
    pub fn build_consumer(self) -> Result<ConsumerLayer<S>, ConfigError> {
        #[cfg(feature = "grpc")]
        if !self.grpc.methods.is_empty() {
            return Err(ConfigError("gRPC methods are named (`grpc_method`): build the gRPC layer with `build_grpc`, and the consumer layer from a builder of its own".into()));
        }
        self.check()?;
        self.config.counters.announce();
        let key_chosen = self.key_chosen;
        let mut config = self.config;
        config.methods = vec![Method::POST];
        config.require_key = true;
        if !key_chosen {
            config.key = KeySource::header(MESSAGE_ID);
        }
        config.front = Arc::new(Consume {
            not_stored: config.not_stored.clone(),
        });
        Ok(ConsumerLayer {
            config: Arc::new(config),
        })
    }
}

/// A method's path as a request carries it: with its leading `/`.
#[cfg(feature = "grpc")]
fn guarded_path(path: &str) -> String {
    if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("/{path}")
    }
}

/// Whether `path` is `/service/method`, each part non-empty and without spaces.
#[cfg(feature = "grpc")]
fn is_grpc_path(path: &str) -> bool {
    let mut parts = path.trim_start_matches('/').split('/');
    let ok = |part: Option<&str>| {
        part.is_some_and(|p| !p.is_empty() && !p.contains(char::is_whitespace))
    };
    path.starts_with('/') && ok(parts.next()) && ok(parts.next()) && parts.next().is_none()
}

/// The headers a saved request keeps unless the builder says otherwise.
const DEFAULT_SAVED_HEADERS: [HeaderName; 6] = [
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_LANGUAGE,
    header::ACCEPT,
    header::ACCEPT_LANGUAGE,
    crate::key::IDEMPOTENCY_KEY,
];

/// Whether a header's name says it carries a credential.
fn is_secret(name: &HeaderName) -> bool {
    const WORDS: [&str; 7] = [
        "auth", "cookie", "token", "secret", "password", "api-key", "apikey",
    ];
    let name = name.as_str();
    WORDS.iter().any(|word| name.contains(word)) || name.contains("session")
}

/// A configuration the layer refuses; the message names the setting and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("safe-retry-server: {0}")]
pub struct ConfigError(String);
