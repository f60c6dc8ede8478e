//! Idempotency keys: one stable key per logical request, so a retry is recognisable as a copy.
//!
//! A network delivers a request at least once or not at all; only the server can make its
//! *effect* happen exactly once, and only if it can tell a retry from a new request. The key is
//! that tell. The middleware decides it once, before the first attempt, and every attempt carries
//! the identical header value. A server that dedupes on the key (see the draft
//! `draft-ietf-httpapi-idempotency-key-header`) then performs the effect once, however many copies
//! arrive, and answers the copies with the stored response.
//!
//! When to stamp and when to supply a key, and what the server must do, are documented on
//! [`IdempotencyKeys`], where users read them.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method};

use crate::error::InvalidConfig;

/// The area named in this module's configuration errors.
const KEYS: &str = "idempotency keys";
use crate::rng::{RandomSource, SeededRng};

/// The default header name, per the IETF draft.
const DEFAULT_HEADER: &str = "idempotency-key";

/// How a key is written into the header value.
///
/// # Which to pick
///
/// [`Bare`](Self::Bare), the default, unless the server follows the IETF draft to the letter.
/// Servers in use take the key as it comes: Stripe and the APIs modelled on it document bare
/// values, and server libraries either validate it as a bare value (Django's
/// drf-idempotency answers `400` to anything but letters, digits and `-._~:`, so a quoted key
/// fails every request) or store the quotes as part of the key (so a client that switches
/// forms gets the effect twice). A UUID is letters, digits and `-`, which every one of them
/// accepts. The draft (`draft-ietf-httpapi-idempotency-key-header`, expired) asks for a
/// Structured Field String, `"8e03…"`: pick [`Quoted`](Self::Quoted) for a server that parses
/// it as one and rejects a bare value.
///
/// Keep one format per server for good: the same operation sent once in each form may be two
/// keys to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum KeyFormat {
    /// The bare key: `Idempotency-Key: 8e03…`. The default. A key the middleware makes is a
    /// UUID (letters, digits, `-`); a key from a [`KeySource`] must be visible ASCII without
    /// spaces, quotes or backslashes.
    #[default]
    Bare,
    /// A Structured Field String, as the IETF draft specifies: `Idempotency-Key: "8e03…"`.
    Quoted,
}

/// Where new keys come from, for keys of your own making (a prefix your server expects, say);
/// the default, random UUIDs, needs none, and [`SeededKeys`] repeats its keys from run to run.
///
/// Any `Fn() -> String` closure that is `Send + Sync` is a `KeySource`:
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use reqwest_safe_retry::KeySource;
///
/// let counter = AtomicU64::new(0);
/// let keys = move || format!("order-{}", counter.fetch_add(1, Ordering::Relaxed));
/// assert_eq!(keys.next_key(), "order-0");
/// assert_eq!(keys.next_key(), "order-1");
/// ```
pub trait KeySource: Send + Sync + 'static {
    /// A new key, different from every key this source returned before.
    fn next_key(&self) -> String;
}

impl<F> KeySource for F
where
    F: Fn() -> String + Send + Sync + 'static,
{
    fn next_key(&self) -> String {
        self()
    }
}

/// Version 4 UUIDs drawn from a seed: the same seed gives the same keys, for reproducible tests.
///
/// ```
/// use reqwest_safe_retry::{KeySource, SeededKeys};
///
/// assert_eq!(SeededKeys::new(1).next_key(), SeededKeys::new(1).next_key());
/// assert_eq!(SeededKeys::new(1).next_key().len(), 36);
/// ```
#[derive(Debug, Clone)]
pub struct SeededKeys {
    rng: SeededRng,
}

impl SeededKeys {
    /// Creates a source whose keys are determined by `seed`.
    pub fn new(seed: u64) -> Self {
        SeededKeys {
            rng: SeededRng::new(seed),
        }
    }
}

impl KeySource for SeededKeys {
    fn next_key(&self) -> String {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&self.rng.next_u64().to_le_bytes());
        bytes[8..].copy_from_slice(&self.rng.next_u64().to_le_bytes());
        uuid::Builder::from_random_bytes(bytes)
            .into_uuid()
            .to_string()
    }
}

/// How the middleware stamps idempotency keys.
///
/// # When to let the middleware stamp keys, and when to supply your own
///
/// - **Let it stamp** (the default for POST and PATCH) when one call to `send()` is one
///   operation: the key then protects the retries this middleware makes.
/// - **Give the request a [`NaturalKey`]** (an order id and a step) when the same operation may
///   be sent again *outside* this middleware: after a crash, by a queue redelivering a job, or by
///   a user pressing the button twice. The key is derived from it, so every sender computes the
///   same one.
/// - **Set the header yourself** (it is kept byte for byte) only when the server wants a key of
///   its own making, such as one it handed out earlier.
///
/// # What the server must do
///
/// For each `(caller, key)`: claim the key atomically before acting; store a fingerprint of the
/// request and answer `422` to the key reused with another request; answer `409` while the first
/// copy is in progress (this middleware retries it, with the same key); store the completed
/// response and replay it to later copies; keep keys longer than clients retry; answer `400`
/// when a required key is missing. `422` and `400` are never retried.
///
/// ```
/// use reqwest_safe_retry::{Dependency, IdempotencyKeys, KeyFormat, RetryPolicy};
///
/// let keys = IdempotencyKeys::builder()
///     .format(KeyFormat::Quoted)
///     .build()
///     .expect("valid key settings");
/// let payments = Dependency::new("payments", RetryPolicy::default())
///     .with_idempotency_keys(keys)
///     .expect("the key header is the only one named so");
/// # drop(payments);
/// ```
#[derive(Clone)]
pub struct IdempotencyKeys {
    header: HeaderName,
    format: KeyFormat,
    methods: Vec<Method>,
    source: Option<Arc<dyn KeySource>>,
    namespace: uuid::Uuid,
}

impl IdempotencyKeys {
    /// Starts a builder with every default in place.
    pub fn builder() -> IdempotencyKeysBuilder {
        IdempotencyKeysBuilder::default()
    }

    /// The header that carries the key.
    pub fn header_name(&self) -> &HeaderName {
        &self.header
    }

    /// How keys are written into the header.
    pub fn format(&self) -> KeyFormat {
        self.format
    }

    /// The namespace that keys derived from a [`NaturalKey`] are made in; see
    /// [`IdempotencyKeysBuilder::derive_namespace`].
    pub fn derive_namespace(&self) -> u128 {
        self.namespace.as_u128()
    }

    /// Whether a request with this method, and no key of its own, gets one.
    pub fn stamps(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    /// A new key, formatted as a header value.
    ///
    /// The value's bytes are reference-counted from the start (`Bytes::from_owner`), so the
    /// copies that every attempt and the record keep cost no further allocation.
    pub(crate) fn new_value(&self) -> Result<HeaderValue, InvalidKey> {
        let Some(source) = &self.source else {
            // The default: a UUID v4 from the thread-local CSPRNG, cut from a batch.
            let value = match self.format {
                KeyFormat::Quoted => next_batched_key(..),
                KeyFormat::Bare => next_batched_key(1..37),
            };
            // Hex digits, hyphens and quotes: a valid header value by construction.
            return Ok(HeaderValue::from_maybe_shared(value)
                .unwrap_or_else(|_| unreachable!("a formatted UUID is a valid header value")));
        };
        let key = source.next_key();
        let text = format_key(&key, self.format)?;
        HeaderValue::from_maybe_shared(Bytes::from_owner(text)).map_err(|_| InvalidKey {
            key,
            format: Some(self.format),
            rule: QUOTED_TEXT,
        })
    }

    /// The key derived from `natural`: the name-based UUID (version 5) of its bytes in the
    /// namespace, in the configured format.
    fn derived_value(&self, natural: &NaturalKey) -> Result<HeaderValue, InvalidKey> {
        if natural.0.is_empty() {
            return Err(InvalidKey {
                key: String::new(),
                format: Some(self.format),
                rule: EMPTY,
            });
        }
        let uuid = uuid::Uuid::new_v5(&self.namespace, natural.0.as_bytes());
        let mut slot = [b'"'; SLOT];
        uuid.hyphenated().encode_lower(&mut slot[1..37]);
        let text = match self.format {
            KeyFormat::Quoted => &slot[..],
            KeyFormat::Bare => &slot[1..37],
        };
        // Hex digits, hyphens and quotes: a valid header value by construction.
        Ok(HeaderValue::from_bytes(text)
            .unwrap_or_else(|_| unreachable!("a formatted UUID is a valid header value")))
    }
}

/// The natural key of one operation (an order id and a step, a queue message's id), from which
/// the middleware derives the request's idempotency key, the same in every process and on
/// every run.
///
/// A key the middleware stamps lives as long as one call to `send()`. When the same operation
/// may be sent again from outside it, by a job that is re-run after its process crashed (a
/// queue redelivering the message, a cron trying again), a fresh key would make it a new
/// operation to the server, and the effect would happen twice. Put a `NaturalKey` in the
/// request's extensions instead: the key is then derived from it, and the re-run sends the
/// same key as the run that crashed, so a server that dedupes on it performs the effect once
/// and replays its answer.
///
/// ```
/// use reqwest_safe_retry::NaturalKey;
///
/// // The same order and step give the same key, whichever process sends it and however often.
/// // With a reqwest-middleware client: `.with_extension(NaturalKey::new(..))` on the request.
/// let order = 7;
/// let charge = http::Request::post("http://127.0.0.1:8080/charges")
///     .extension(NaturalKey::new(format!("order-{order}/charge")))
///     .body(r#"{"amount": 4200}"#)?;
/// assert!(charge.extensions().get::<NaturalKey>().is_some());
/// # Ok::<(), http::Error>(())
/// ```
///
/// The key is the name-based UUID (version 5) of the natural key's UTF-8 bytes in the
/// dependency's [namespace](IdempotencyKeysBuilder::derive_namespace), in its
/// [`KeyFormat`]: what any UUID library computes from the same two, so a worker in another
/// language can send the same key. It is put on every attempt, whatever the method, and the
/// [`RetryRecord`](crate::RetryRecord) or [`RetryError`](crate::RetryError) shows it. A key
/// header the caller set on the request wins over it, as over a stamped key.
///
/// Name the operation, not only the thing it acts on: `order-42/charge` and `order-42/refund`
/// are two operations, and one natural key for both would make the server replay the charge's
/// answer to the refund. An empty natural key, or one on a dependency
/// [without keys](crate::Dependency::without_idempotency_keys), fails the request before
/// anything is sent, with
/// [`StopReason::InvalidIdempotencyKey`](crate::StopReason::InvalidIdempotencyKey).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NaturalKey(String);

impl NaturalKey {
    /// The natural key `key`: an operation's name that is the same every time it is sent.
    pub fn new(key: impl Into<String>) -> Self {
        NaturalKey(key.into())
    }

    /// The natural key as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A request's key, decided once before its first attempt.
#[derive(Debug, Clone)]
pub(crate) struct Key {
    pub(crate) value: HeaderValue,
    /// Made here: it is put on each attempt's copy as it is sent (the caller's own is already on
    /// the request), and counted as stamped once an attempt is sent.
    pub(crate) stamped: bool,
    /// Made new for this request (a random key): no server can have seen it before its first
    /// attempt. A caller's own key, or one derived from a natural key, may have been sent by an
    /// earlier run.
    pub(crate) fresh: bool,
}

/// The key of a request: the caller's own, kept byte for byte; or one derived from its
/// `natural` key, whatever its method; or a new one if `keys` stamp its method. None without
/// `keys`.
///
/// # Errors
///
/// [`InvalidKey`] when the caller's key cannot be sent as it is (empty, or not in the configured
/// form: another parser would read it differently and defeat the server's dedupe), a custom
/// source made one that cannot be, or the natural key is empty or asks for a key of a
/// dependency without keys.
pub(crate) fn key_for(
    keys: Option<&IdempotencyKeys>,
    method: &Method,
    headers: &http::HeaderMap,
    natural: Option<&NaturalKey>,
) -> Result<Option<Key>, InvalidKey> {
    let Some(keys) = keys else {
        return match natural {
            None => Ok(None),
            Some(natural) => Err(InvalidKey {
                key: natural.0.clone(),
                format: None,
                rule: KEYS_OFF,
            }),
        };
    };
    if let Some(own) = headers.get(keys.header_name()) {
        check_caller_value(own, keys.format())?;
        return Ok(Some(Key {
            value: own.clone(),
            stamped: false,
            fresh: false,
        }));
    }
    if let Some(natural) = natural {
        return keys.derived_value(natural).map(|value| {
            Some(Key {
                value,
                stamped: true,
                fresh: false,
            })
        });
    }
    if !keys.stamps(method) {
        return Ok(None);
    }
    keys.new_value().map(|value| {
        Some(Key {
            value,
            stamped: true,
            fresh: true,
        })
    })
}

/// Puts a stamped `key` on the copy of the request an attempt sends (a caller's own key is on it
/// already).
#[inline]
pub(crate) fn put_on(
    keys: Option<&IdempotencyKeys>,
    key: Option<&Key>,
    sending: &mut http::HeaderMap,
) {
    if let (
        Some(keys),
        Some(Key {
            value,
            stamped: true,
            ..
        }),
    ) = (keys, key)
    {
        sending.insert(keys.header_name(), value.clone());
    }
}

/// How many default keys are made at once.
const BATCH: usize = 32;

/// A default key's slot in a batch: a quoted UUID, `"` + 36 characters + `"`. The bare form is
/// the same slot without its quotes.
const SLOT: usize = 38;

thread_local! {
    /// Keys made ahead on this thread.
    static MADE_AHEAD: std::cell::RefCell<MadeAhead> = std::cell::RefCell::default();
}

/// A thread's batches of default keys: the batch keys are cut from, how many of them are still
/// unused, and the two buffers batches are written into in turn.
#[derive(Default)]
struct MadeAhead {
    batch: Bytes,
    left: usize,
    buffers: [bytes::BytesMut; 2],
    next: usize,
}

/// The `range` of the next default key's slot (`..` quoted, `1..37` bare). Keys are made
/// [`BATCH`] at a time into one reference-counted buffer, so a key costs no allocation of its
/// own: every copy of it, on every attempt and in the record, shares the batch. Batches are
/// written into two buffers in turn, and a buffer is written over once none of the keys of the
/// batch before last is still held (those of the last batch may still be, by a connection that
/// has not yet dropped its request): keys made one request after another cost no allocation at
/// all. (A key kept for long keeps its batch's 1.2 kB alive with it, and the buffer is then
/// allocated anew.)
fn next_batched_key(range: impl std::ops::RangeBounds<usize>) -> Bytes {
    MADE_AHEAD.with_borrow_mut(|made| {
        if made.left == 0 {
            let buffer = &mut made.buffers[made.next];
            made.next ^= 1;
            // Reclaims the buffer in place when no part of it is held, allocates otherwise.
            buffer.resize(SLOT * BATCH, 0);
            fill_batch(buffer);
            made.batch = buffer.split().freeze();
            made.left = BATCH;
        }
        made.left -= 1;
        let start = made.left * SLOT;
        made.batch.slice(start..start + SLOT).slice(range)
    })
}

/// Writes [`BATCH`] quoted UUIDs v4 into `text` from the thread-local generator of `rand`
/// (seeded by the operating system, which spares a system call per key), one random draw for
/// all of them.
fn fill_batch(text: &mut [u8]) {
    let mut random = [0u8; 16 * BATCH];
    rand::Rng::fill_bytes(&mut rand::rng(), &mut random);
    for (bytes, slot) in random.chunks_exact(16).zip(text.chunks_exact_mut(SLOT)) {
        let bytes: [u8; 16] = bytes
            .try_into()
            .unwrap_or_else(|_| unreachable!("16 bytes"));
        let uuid = uuid::Builder::from_random_bytes(bytes).into_uuid();
        slot[0] = b'"';
        uuid.hyphenated().encode_lower(&mut slot[1..37]);
        slot[37] = b'"';
    }
}

impl Default for IdempotencyKeys {
    /// The keys every [`Dependency`](crate::Dependency) starts with: what
    /// `IdempotencyKeys::builder().build()` makes, a bare random UUID on POST and PATCH in
    /// `Idempotency-Key`.
    fn default() -> Self {
        IdempotencyKeysBuilder::default()
            .build()
            .unwrap_or_else(|e| unreachable!("default key settings are invalid: {e}"))
    }
}

impl fmt::Debug for IdempotencyKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyKeys")
            .field("header", &self.header)
            .field("format", &self.format)
            .field("methods", &self.methods)
            .field(
                "source",
                &if self.source.is_some() {
                    "custom"
                } else {
                    "uuid v4"
                },
            )
            .field("derive_namespace", &self.namespace)
            .finish()
    }
}

/// Builds [`IdempotencyKeys`].
///
/// # Default
///
/// | setting | default |
/// |---|---|
/// | [`header_name`](Self::header_name) | `Idempotency-Key` |
/// | [`format`](Self::format) | [`KeyFormat::Bare`] |
/// | [`stamp_methods`](Self::stamp_methods) | POST, PATCH |
/// | [`key_source`](Self::key_source) | a random UUID v4 from the operating system's entropy |
/// | [`derive_namespace`](Self::derive_namespace) | `761624f8-19f0-4ca5-81cb-8475aedcde4c`, the same in every release |
#[derive(Clone)]
pub struct IdempotencyKeysBuilder {
    header: String,
    format: KeyFormat,
    methods: Vec<Method>,
    source: Option<Arc<dyn KeySource>>,
    namespace: uuid::Uuid,
}

/// The namespace of derived keys unless one is set: `761624f8-19f0-4ca5-81cb-8475aedcde4c`,
/// fixed for good, since changing it would change every derived key.
const DEFAULT_NAMESPACE: uuid::Uuid = uuid::Uuid::from_u128(0x761624f8_19f0_4ca5_81cb_8475aedcde4c);

impl Default for IdempotencyKeysBuilder {
    fn default() -> Self {
        IdempotencyKeysBuilder {
            header: DEFAULT_HEADER.to_owned(),
            format: KeyFormat::Bare,
            methods: vec![Method::POST, Method::PATCH],
            source: None,
            namespace: DEFAULT_NAMESPACE,
        }
    }
}

impl fmt::Debug for IdempotencyKeysBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyKeysBuilder")
            .field("header", &self.header)
            .field("format", &self.format)
            .field("methods", &self.methods)
            .field("custom_source", &self.source.is_some())
            .field("derive_namespace", &self.namespace)
            .finish()
    }
}

impl IdempotencyKeysBuilder {
    /// The header that carries the key. A request that already has it keeps its value, whatever
    /// its method, and counts as keyed.
    pub fn header_name(mut self, name: impl Into<String>) -> Self {
        self.header = name.into();
        self
    }

    /// How keys are written into the header value.
    pub fn format(mut self, format: KeyFormat) -> Self {
        self.format = format;
        self
    }

    /// The methods whose requests get a key when they have none. An empty set turns stamping
    /// off; keys that callers set are still recognised.
    pub fn stamp_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Where new keys come from. Keys derived from a [`NaturalKey`] do not come from it.
    pub fn key_source(mut self, source: impl KeySource) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// The namespace, a UUID as a number, that keys derived from a [`NaturalKey`] are made in:
    /// the name-based UUID of a natural key depends on it. Set it to the namespace another
    /// sender of the same operations uses (a worker in another language computing
    /// `uuid5(namespace, natural_key)`), so both send the same key; keep it fixed, since
    /// changing it changes every derived key.
    ///
    /// ```
    /// use reqwest_safe_retry::IdempotencyKeys;
    ///
    /// let keys = IdempotencyKeys::builder()
    ///     .derive_namespace(0x6ba7b811_9dad_11d1_80b4_00c04fd430c8)
    ///     .build()?;
    /// assert_eq!(keys.derive_namespace(), 0x6ba7b811_9dad_11d1_80b4_00c04fd430c8);
    /// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
    /// ```
    pub fn derive_namespace(mut self, namespace: u128) -> Self {
        self.namespace = uuid::Uuid::from_u128(namespace);
        self
    }

    /// Validates the settings.
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] when the header name is not a valid HTTP header name, or is a standard
    /// field (`Content-Type`, `Authorization`, `Host`, ...) that means something else.
    pub fn build(self) -> Result<IdempotencyKeys, InvalidConfig> {
        let lower = self.header.to_ascii_lowercase();
        if STANDARD_FIELDS.contains(&lower.as_str()) {
            return Err(InvalidConfig::new(
                KEYS,
                format!(
                    "header name {:?} is a standard HTTP field that carries something else, so \
                     every request with it would count as keyed: choose a name of its own, such \
                     as \"Idempotency-Key\"",
                    self.header
                ),
            ));
        }
        let header = if self.header.eq_ignore_ascii_case(DEFAULT_HEADER) {
            // A static name is shared, not copied, each time a request is stamped.
            HeaderName::from_static(DEFAULT_HEADER)
        } else {
            HeaderName::from_bytes(self.header.as_bytes()).map_err(|_| {
                InvalidConfig::new(
                    KEYS,
                    format!(
                        "header name {:?} is not a valid HTTP header name: \
                 use letters, digits and '-'",
                        self.header
                    ),
                )
            })?
        };
        Ok(IdempotencyKeys {
            header,
            format: self.format,
            methods: self.methods,
            source: self.source,
            namespace: self.namespace,
        })
    }
}

/// A key that cannot be sent in the configured format (an empty one included), from the key
/// source, set by the caller, or asked for with a [`NaturalKey`]; the request is not sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InvalidKey {
    key: String,
    /// The configured format, if the dependency has keys.
    format: Option<KeyFormat>,
    rule: &'static str,
}

impl fmt::Display for InvalidKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.format {
            Some(format) => write!(
                f,
                "idempotency key {:?} cannot be sent as a {format:?} key: {}",
                self.key, self.rule
            ),
            None => write!(
                f,
                "idempotency key {:?} cannot be sent: {}",
                self.key, self.rule
            ),
        }
    }
}

impl std::error::Error for InvalidKey {}

impl InvalidKey {
    /// The key that was rejected (lossily decoded, if it was not UTF-8).
    #[cfg(test)]
    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    /// The rule it broke.
    #[cfg(test)]
    pub(crate) fn rule(&self) -> &'static str {
        self.rule
    }
}

const EMPTY: &str = "an empty key cannot tell one request from another";
const KEYS_OFF: &str = "the request carries a NaturalKey, but its dependency sends no \
     idempotency keys (without_idempotency_keys): turn keys on for it, or send the request \
     without the NaturalKey";
const QUOTED_TEXT: &str = "a Structured Field String holds printable ASCII (0x20-0x7E), with '\"' \
     and '\\' escaped by a backslash";
const QUOTES: &str = "a quoted key (the configured format) must start and end with '\"'";
const BARE_TEXT: &str = "a bare key must be visible ASCII (0x21-0x7E), without spaces or quotes";

/// Writes `key` in `format`, or says why it cannot be sent.
///
/// A Structured Field String (RFC 8941 §3.3.3) holds printable ASCII (0x20-0x7E), with `"` and
/// `\` escaped by a backslash. A bare key must be visible ASCII without spaces or quotes, so that
/// the value means the same to every parser. Neither may be empty.
pub(crate) fn format_key(key: &str, format: KeyFormat) -> Result<String, InvalidKey> {
    let invalid = |rule| InvalidKey {
        key: key.to_owned(),
        format: Some(format),
        rule,
    };
    if key.is_empty() {
        return Err(invalid(EMPTY));
    }
    match format {
        KeyFormat::Quoted => {
            if !key.bytes().all(|b| (0x20..=0x7E).contains(&b)) {
                return Err(invalid(QUOTED_TEXT));
            }
            let mut out = String::with_capacity(key.len() + 2);
            out.push('"');
            for c in key.chars() {
                if c == '"' || c == '\\' {
                    out.push('\\');
                }
                out.push(c);
            }
            out.push('"');
            Ok(out)
        }
        KeyFormat::Bare => {
            if !key.bytes().all(is_bare) {
                return Err(invalid(BARE_TEXT));
            }
            Ok(key.to_owned())
        }
    }
}

fn is_bare(b: u8) -> bool {
    (0x21..=0x7E).contains(&b) && b != b'"' && b != b'\\'
}

/// Checks a header value the caller set as the key: it is sent as it is, so it must already be
/// a valid key. Under [`KeyFormat::Bare`] that is a bare key or a well-formed quoted one (the
/// caller may know their server wants quotes); under [`KeyFormat::Quoted`], a quoted one.
pub(crate) fn check_caller_value(value: &HeaderValue, format: KeyFormat) -> Result<(), InvalidKey> {
    let bytes = value.as_bytes();
    let rule = match format {
        KeyFormat::Bare if bytes.first() == Some(&b'"') => quoted_rule(bytes),
        KeyFormat::Quoted => quoted_rule(bytes),
        KeyFormat::Bare if bytes.is_empty() => Some(EMPTY),
        KeyFormat::Bare => (!bytes.iter().copied().all(is_bare)).then_some(BARE_TEXT),
    };
    match rule {
        None => Ok(()),
        Some(rule) => Err(InvalidKey {
            key: String::from_utf8_lossy(bytes).into_owned(),
            format: Some(format),
            rule,
        }),
    }
}

/// The rule a quoted key breaks, if any: `"`, then visible ASCII or spaces with `"` and `\`
/// escaped by a backslash, then `"`; not empty.
fn quoted_rule(bytes: &[u8]) -> Option<&'static str> {
    if bytes.is_empty() || bytes == b"\"\"" {
        return Some(EMPTY);
    }
    let Some(inner) = bytes
        .strip_prefix(b"\"")
        .and_then(|rest| rest.strip_suffix(b"\""))
    else {
        return Some(QUOTES);
    };
    let mut escaped = false;
    for &b in inner {
        let ok = match (escaped, b) {
            (true, b'"' | b'\\') => {
                escaped = false;
                true
            }
            (true, _) => false,
            (false, b'\\') => {
                escaped = true;
                true
            }
            (false, b'"') => false,
            (false, b) => (0x20..=0x7E).contains(&b),
        };
        if !ok {
            return Some(QUOTED_TEXT);
        }
    }
    escaped.then_some(QUOTED_TEXT)
}

/// Standard fields that mean something else. A key header of one of these names would make
/// every request that carries the field (a JSON POST's `Content-Type`) count as keyed, and so be
/// retried as if the server could dedupe it.
pub(crate) const STANDARD_FIELDS: &[&str] = &[
    "accept",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "connection",
    "content-disposition",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-range",
    "content-type",
    "cookie",
    "date",
    "etag",
    "expect",
    "expires",
    "forwarded",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "keep-alive",
    "last-modified",
    "link",
    "location",
    "max-forwards",
    "origin",
    "pragma",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "retry-after",
    "server",
    "set-cookie",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "user-agent",
    "vary",
    "via",
    "warning",
    "www-authenticate",
    "idempotent-replayed",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_keys_are_structured_field_strings() {
        assert_eq!(
            format_key("abc-123", KeyFormat::Quoted).unwrap(),
            "\"abc-123\""
        );
        assert_eq!(
            format_key(r#"say "hi" \o/"#, KeyFormat::Quoted).unwrap(),
            r#""say \"hi\" \\o/""#
        );
        assert_eq!(
            format_key("with space", KeyFormat::Quoted).unwrap(),
            "\"with space\""
        );
    }

    #[test]
    fn token_keys_are_sent_bare() {
        assert_eq!(format_key("order-42", KeyFormat::Bare).unwrap(), "order-42");
    }

    #[test]
    fn keys_that_cannot_be_sent_whole_are_rejected() {
        for format in [KeyFormat::Quoted, KeyFormat::Bare] {
            for bad in ["", "line\r\nbreak", "tab\there", "naïve", "nul\0"] {
                let err = format_key(bad, format).unwrap_err();
                assert_eq!(err.key(), bad);
            }
        }
        assert!(format_key("has space", KeyFormat::Bare).is_err());
    }

    #[test]
    fn the_rejection_says_what_keys_may_contain() {
        let err = format_key("a\nb", KeyFormat::Bare).unwrap_err();
        assert_eq!(
            err.to_string(),
            "idempotency key \"a\\nb\" cannot be sent as a Bare key: a bare key must be \
             visible ASCII (0x21-0x7E), without spaces or quotes"
        );
        assert_eq!(format_key("", KeyFormat::Quoted).unwrap_err().rule(), EMPTY);
    }

    #[test]
    fn a_caller_s_key_must_already_be_a_valid_key() {
        let value = |v: &[u8]| HeaderValue::from_bytes(v).unwrap();
        let cases: [(&[u8], KeyFormat, Result<(), &str>); 20] = [
            (b"\"order-42\"", KeyFormat::Quoted, Ok(())),
            (b"\"with space\"", KeyFormat::Quoted, Ok(())),
            (br#""say \"hi\" \\o/""#, KeyFormat::Quoted, Ok(())),
            (b"", KeyFormat::Quoted, Err(EMPTY)),
            (b"\"\"", KeyFormat::Quoted, Err(EMPTY)),
            (b"order-42", KeyFormat::Quoted, Err(QUOTES)),
            (b"\"unterminated", KeyFormat::Quoted, Err(QUOTES)),
            (br#""a"b""#, KeyFormat::Quoted, Err(QUOTED_TEXT)),
            (br#""a\b""#, KeyFormat::Quoted, Err(QUOTED_TEXT)),
            (b"\"caf\xc3\xa9\"", KeyFormat::Quoted, Err(QUOTED_TEXT)),
            (b"order-42", KeyFormat::Bare, Ok(())),
            (b"8e03-aa:~._", KeyFormat::Bare, Ok(())),
            (b"", KeyFormat::Bare, Err(EMPTY)),
            (b"with space", KeyFormat::Bare, Err(BARE_TEXT)),
            (b"caf\xc3\xa9", KeyFormat::Bare, Err(BARE_TEXT)),
            (b"a\"b", KeyFormat::Bare, Err(BARE_TEXT)),
            // Under the bare format a caller may still send a quoted key, if well formed.
            (b"\"quoted\"", KeyFormat::Bare, Ok(())),
            (b"\"with space\"", KeyFormat::Bare, Ok(())),
            (b"\"\"", KeyFormat::Bare, Err(EMPTY)),
            (b"\"unterminated", KeyFormat::Bare, Err(QUOTES)),
        ];
        for (bytes, format, expected) in cases {
            let got = check_caller_value(&value(bytes), format).map_err(|e| e.rule());
            assert_eq!(
                got,
                expected,
                "{:?} as {format:?}",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn keys_and_their_builder_debug_without_the_source() {
        let builder = IdempotencyKeys::builder()
            .format(KeyFormat::Bare)
            .stamp_methods([Method::POST])
            .key_source(|| "k".to_owned());
        assert_eq!(
            format!("{builder:?}"),
            "IdempotencyKeysBuilder { header: \"idempotency-key\", format: Bare, \
             methods: [POST], custom_source: true, \
             derive_namespace: 761624f8-19f0-4ca5-81cb-8475aedcde4c }"
        );
        let keys = builder.build().unwrap();
        assert_eq!(keys.format(), KeyFormat::Bare);
        assert!(keys.stamps(&Method::POST) && !keys.stamps(&Method::PATCH));
        assert_eq!(
            format!("{keys:?}"),
            "IdempotencyKeys { header: \"idempotency-key\", format: Bare, methods: [POST], \
             source: \"custom\", derive_namespace: 761624f8-19f0-4ca5-81cb-8475aedcde4c }"
        );
    }

    #[test]
    fn the_default_key_values_are_distinct_and_well_formed() {
        for (format, len) in [(KeyFormat::Quoted, 38), (KeyFormat::Bare, 36)] {
            let keys = IdempotencyKeys::builder().format(format).build().unwrap();
            let a = keys.new_value().unwrap();
            let b = keys.new_value().unwrap();
            assert_ne!(a, b);
            assert_eq!(a.len(), len);
            assert!(check_caller_value(&a, format).is_ok(), "{a:?}");
        }
    }

    #[test]
    fn default_keys_made_in_batches_stay_distinct_across_batches_and_formats() {
        let bare = IdempotencyKeys::default();
        let quoted = IdempotencyKeys::builder()
            .format(KeyFormat::Quoted)
            .build()
            .unwrap();
        let mut seen = std::collections::HashSet::new();
        // Three batches' worth, the two formats drawing from the same batches in turn.
        for i in 0..3 * BATCH {
            let (keys, len) = if i % 3 == 0 {
                (&bare, 36)
            } else {
                (&quoted, 38)
            };
            let value = keys.new_value().unwrap();
            let text = value.to_str().unwrap();
            assert_eq!(text.len(), len, "{text}");
            let uuid = text.trim_matches('"');
            assert_eq!(uuid::Uuid::parse_str(uuid).unwrap().get_version_num(), 4);
            assert!(seen.insert(uuid.to_owned()), "{uuid} was made twice");
        }
    }

    #[test]
    fn a_key_still_held_keeps_its_value_when_its_batch_is_used_up_and_made_again() {
        let keys = IdempotencyKeys::default();
        let held = keys.new_value().unwrap();
        let text = held.to_str().unwrap().to_owned();
        let mut later = std::collections::HashSet::new();
        for _ in 0..3 * BATCH {
            later.insert(keys.new_value().unwrap().to_str().unwrap().to_owned());
        }
        assert_eq!(held.to_str().unwrap(), text, "its bytes were written over");
        assert!(!later.contains(&text));
        assert_eq!(later.len(), 3 * BATCH, "a key was made twice");
    }

    #[test]
    fn standard_fields_are_refused_as_the_key_header() {
        for name in ["content-type", "Authorization", "HOST", "retry-after"] {
            let err = IdempotencyKeys::builder()
                .header_name(name)
                .build()
                .unwrap_err();
            assert_eq!(
                err.to_string(),
                format!(
                    "invalid idempotency keys: header name {name:?} is a standard HTTP field that \
                     carries something else, so every request with it would count as keyed: \
                     choose a name of its own, such as \"Idempotency-Key\""
                )
            );
        }
        assert!(
            IdempotencyKeys::builder()
                .header_name("X-Request-Key")
                .build()
                .is_ok()
        );
    }

    #[test]
    fn default_keys_are_bare_uuid_v4_on_post_and_patch() {
        let keys = IdempotencyKeys::default();
        assert_eq!(keys.header_name(), "idempotency-key");
        assert_eq!(keys.format(), KeyFormat::Bare);
        assert!(keys.stamps(&Method::POST) && keys.stamps(&Method::PATCH));
        assert!(!keys.stamps(&Method::GET) && !keys.stamps(&Method::PUT));
        let value = keys.new_value().unwrap();
        let text = value.to_str().unwrap();
        assert_eq!(text.len(), 36);
        let uuid = uuid::Uuid::parse_str(text).unwrap();
        assert_eq!(uuid.get_version_num(), 4);
        assert_eq!(uuid.hyphenated().to_string(), text, "lowercase, hyphenated");
        assert_ne!(keys.new_value().unwrap(), value);
    }

    #[test]
    fn default_token_keys_are_bare_uuids() {
        let keys = IdempotencyKeys::builder()
            .format(KeyFormat::Bare)
            .build()
            .unwrap();
        let value = keys.new_value().unwrap();
        assert!(uuid::Uuid::parse_str(value.to_str().unwrap()).is_ok());
    }

    #[test]
    fn seeded_keys_repeat_and_look_like_uuid_v4() {
        let a = SeededKeys::new(5);
        let b = SeededKeys::new(5);
        let xs: Vec<String> = (0..3).map(|_| a.next_key()).collect();
        let ys: Vec<String> = (0..3).map(|_| b.next_key()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs[0], xs[1]);
        assert_eq!(uuid::Uuid::parse_str(&xs[0]).unwrap().get_version_num(), 4);
    }

    #[test]
    fn an_invalid_header_name_is_rejected_in_build() {
        let err = IdempotencyKeys::builder()
            .header_name("Idempotency Key")
            .build()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid idempotency keys: header name \"Idempotency Key\" is not a valid \
             HTTP header name: use letters, digits and '-'"
        );
    }

    #[test]
    fn a_custom_source_that_returns_a_bad_key_is_reported() {
        let keys = IdempotencyKeys::builder()
            .key_source(|| "bad\nkey".to_owned())
            .build()
            .unwrap();
        assert_eq!(keys.new_value().unwrap_err().key(), "bad\nkey");
    }

    /// The key `keys` give a request with `method`, header `own` if any, and natural key.
    fn derived(
        keys: Option<&IdempotencyKeys>,
        method: Method,
        own: Option<&'static str>,
        natural: &str,
    ) -> Result<Option<Key>, InvalidKey> {
        let mut headers = http::HeaderMap::new();
        if let Some(own) = own {
            headers.insert(DEFAULT_HEADER, HeaderValue::from_static(own));
        }
        key_for(keys, &method, &headers, Some(&NaturalKey::new(natural)))
    }

    #[test]
    fn a_derived_key_is_the_uuid_v5_of_the_natural_key_in_the_namespace() {
        // Computed apart, by Python's `uuid.uuid5(UUID("761624f8-..."), name)`.
        let keys = IdempotencyKeys::default();
        let table = [
            ("order-42/charge", "a84c0017-db11-533d-b2ac-49d735995854"),
            ("order-42/refund", "ca258721-a919-551f-83fd-088ec02ff84e"),
            ("commande-42/é", "f81d1706-bcd4-5ab8-ae78-e78365db7af9"),
        ];
        for (natural, uuid) in table {
            let key = derived(Some(&keys), Method::POST, None, natural)
                .unwrap()
                .unwrap();
            assert_eq!(key.value, uuid, "{natural}");
            assert!(key.stamped, "put on each attempt by the middleware");
        }
        assert_eq!(
            keys.derive_namespace(),
            0x761624f8_19f0_4ca5_81cb_8475aedcde4c
        );
        // Another namespace, another key: here RFC 9562's URL namespace.
        let url = IdempotencyKeys::builder()
            .derive_namespace(0x6ba7b811_9dad_11d1_80b4_00c04fd430c8)
            .build()
            .unwrap();
        assert_eq!(
            url.derive_namespace(),
            0x6ba7b811_9dad_11d1_80b4_00c04fd430c8
        );
        let key = derived(Some(&url), Method::POST, None, "order-42/charge");
        assert_eq!(
            key.unwrap().unwrap().value,
            "7ac176ad-6896-53cd-b650-c6b87028e76f"
        );
        let quoted = IdempotencyKeys::builder()
            .format(KeyFormat::Quoted)
            .build()
            .unwrap();
        let key = derived(Some(&quoted), Method::POST, None, "order-42/charge");
        assert_eq!(
            key.unwrap().unwrap().value,
            "\"a84c0017-db11-533d-b2ac-49d735995854\""
        );
    }

    #[test]
    fn a_natural_key_keys_any_method_and_yields_to_the_caller_s_own_header() {
        let none_stamped = IdempotencyKeys::builder()
            .stamp_methods([])
            .build()
            .unwrap();
        for method in [Method::GET, Method::DELETE, Method::POST] {
            let key = derived(Some(&none_stamped), method.clone(), None, "job-7");
            assert!(key.unwrap().is_some(), "{method}");
        }
        let own = derived(Some(&none_stamped), Method::POST, Some("mine-1"), "job-7")
            .unwrap()
            .unwrap();
        assert_eq!((own.value.as_bytes(), own.stamped), (&b"mine-1"[..], false));
    }

    #[test]
    fn an_empty_natural_key_or_one_without_keys_is_refused_with_what_to_do() {
        let empty = derived(Some(&IdempotencyKeys::default()), Method::POST, None, "");
        assert_eq!(empty.unwrap_err().rule(), EMPTY);
        let off = derived(None, Method::POST, None, "order-42/charge").unwrap_err();
        assert_eq!(
            off.to_string(),
            "idempotency key \"order-42/charge\" cannot be sent: the request carries a \
             NaturalKey, but its dependency sends no idempotency keys (without_idempotency_keys): \
             turn keys on for it, or send the request without the NaturalKey"
        );
        // Without a natural key, no keys means no key and no error.
        let headers = http::HeaderMap::new();
        assert!(
            key_for(None, &Method::POST, &headers, None)
                .unwrap()
                .is_none()
        );
        assert_eq!(NaturalKey::new("a/b").as_str(), "a/b");
    }
}
