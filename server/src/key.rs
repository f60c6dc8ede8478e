//! Where a request's idempotency key comes from, and what a well-formed key is.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderName};

/// The header this crate's client sends, and the IETF draft names.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Which spellings of the `Idempotency-Key` header the layer accepts.
///
/// The IETF draft makes the field a Structured Field String (`"8e03978e-…"`); most servers in
/// the field accept the bare value (`8e03978e-…`), and some clients send only that. Under
/// [`KeyForm::Either`] (the default) `"abc"` and `abc` are one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeyForm {
    /// The quoted form and the bare form, as one key. The default.
    #[default]
    Either,
    /// Only the bare form: a quoted value is malformed.
    Bare,
    /// Only the quoted Structured Field String: a bare value is malformed.
    Quoted,
}

type KeyFn = dyn Fn(&Parts, &Bytes) -> Result<Option<String>, String> + Send + Sync;

/// Where the layer reads a request's key.
///
/// Every key, whatever its source, must be 1 to `max_key_len` bytes (255 by default) of
/// visible ASCII (`!` to `~`) or spaces inside it; anything else is answered `400` with the
/// reason.
#[derive(Clone)]
pub struct KeySource(Source);

#[derive(Clone)]
enum Source {
    IdempotencyKey(KeyForm),
    Header(HeaderName),
    JsonPointer(String),
    Fn(Arc<KeyFn>),
    Either(Arc<(KeySource, KeySource)>),
}

impl KeySource {
    /// The `Idempotency-Key` header in the given spellings. The default is
    /// `KeySource::idempotency_key(KeyForm::Either)`.
    pub fn idempotency_key(form: KeyForm) -> KeySource {
        KeySource(Source::IdempotencyKey(form))
    }

    /// Another header's value, as it is: a webhook's delivery id such as `X-GitHub-Delivery`.
    pub fn header(name: HeaderName) -> KeySource {
        KeySource(Source::Header(name))
    }

    /// A string or number in the JSON body at `pointer` (RFC 6901, e.g. `/event/id`): a
    /// webhook whose event id travels in its payload. A body that is not JSON, or has nothing
    /// there, has no key.
    pub fn json_pointer(pointer: impl Into<String>) -> KeySource {
        KeySource(Source::JsonPointer(pointer.into()))
    }

    /// A function of the request's head and body: `Ok(None)` when the request has no key,
    /// `Err(reason)` when the key it carries is malformed (the reason goes into the `400`).
    pub fn from_fn<F>(f: F) -> KeySource
    where
        F: Fn(&Parts, &Bytes) -> Result<Option<String>, String> + Send + Sync + 'static,
    {
        KeySource(Source::Fn(Arc::new(f)))
    }

    /// This source, or where it finds nothing, `other`: a webhook whose event id comes in a
    /// header from some senders and in the JSON body from others
    /// (`KeySource::header(name).or(KeySource::json_pointer("/id"))`). A key this source finds
    /// malformed is refused; `other` is asked only when this source finds no key.
    pub fn or(self, other: KeySource) -> KeySource {
        KeySource(Source::Either(Arc::new((self, other))))
    }

    /// Whether the key is read from the body, so the body must be read before the key.
    pub(crate) fn needs_body(&self) -> bool {
        match &self.0 {
            Source::JsonPointer(_) | Source::Fn(_) => true,
            Source::Either(both) => both.0.needs_body() || both.1.needs_body(),
            Source::IdempotencyKey(_) | Source::Header(_) => false,
        }
    }

    /// Reads the key: `Ok(None)` when the request carries none.
    pub(crate) fn read(
        &self,
        parts: &Parts,
        body: &Bytes,
        max_len: usize,
    ) -> Result<Option<String>, KeyError> {
        let key = match &self.0 {
            Source::IdempotencyKey(form) => {
                return from_idempotency_key(&parts.headers, *form, max_len);
            }
            Source::Header(name) => match single(&parts.headers, name)? {
                None => None,
                Some(value) => Some(
                    std::str::from_utf8(value)
                        .map_err(|_| KeyError::Invalid("it is not text".into()))?
                        .to_owned(),
                ),
            },
            Source::JsonPointer(pointer) => serde_json::from_slice::<serde_json::Value>(body)
                .ok()
                .and_then(|json| match json.pointer(pointer)? {
                    serde_json::Value::String(s) => Some(s.clone()),
                    serde_json::Value::Number(n) => Some(n.to_string()),
                    _ => None,
                }),
            Source::Fn(f) => f(parts, body).map_err(KeyError::Invalid)?,
            Source::Either(both) => {
                return match both.0.read(parts, body, max_len)? {
                    Some(key) => Ok(Some(key)),
                    None => both.1.read(parts, body, max_len),
                };
            }
        };
        key.map(|key| check(&key, max_len).map(|()| key))
            .transpose()
    }
}

impl Default for KeySource {
    fn default() -> KeySource {
        KeySource::idempotency_key(KeyForm::Either)
    }
}

impl fmt::Debug for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Source::IdempotencyKey(form) => f.debug_tuple("IdempotencyKey").field(form).finish(),
            Source::Header(name) => f.debug_tuple("Header").field(name).finish(),
            Source::JsonPointer(pointer) => f.debug_tuple("JsonPointer").field(pointer).finish(),
            Source::Fn(_) => f.write_str("Fn(..)"),
            Source::Either(both) => f.debug_tuple("Or").field(&both.0).field(&both.1).finish(),
        }
    }
}

/// Why a request's key was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyError {
    /// The header appears more than once.
    Repeated,
    /// The key is malformed; the reason says how.
    Invalid(String),
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Repeated => {
                f.write_str("the key's header appears more than once; send it once")
            }
            KeyError::Invalid(reason) => write!(f, "the idempotency key is malformed: {reason}"),
        }
    }
}

fn single<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Result<Option<&'a [u8]>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let first = values.next();
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    Ok(first.map(|v| v.as_bytes()))
}

fn from_idempotency_key(
    headers: &HeaderMap,
    form: KeyForm,
    max_len: usize,
) -> Result<Option<String>, KeyError> {
    let Some(raw) = single(headers, &IDEMPOTENCY_KEY)? else {
        return Ok(None);
    };
    // Structured fields ignore spaces around a value; so does the bare form.
    let value = raw.trim_ascii();
    let key = if value.first() == Some(&b'"') {
        if form == KeyForm::Bare {
            return Err(KeyError::Invalid(
                "it is quoted; this server takes the bare form".into(),
            ));
        }
        sf_string(value)?
    } else {
        if form == KeyForm::Quoted {
            return Err(KeyError::Invalid(
                "it is not a quoted string; this server takes the Structured Field form (\"…\")"
                    .into(),
            ));
        }
        let text =
            std::str::from_utf8(value).map_err(|_| KeyError::Invalid("it is not ASCII".into()))?;
        if text.contains(',') {
            // Two `Idempotency-Key` lines that a proxy merged into one read `k1, k2`: which of
            // the two was meant cannot be told, and taking both as one key would run the
            // request under a key its client never sent.
            return Err(KeyError::Invalid(
                "it holds a comma: two keys joined into one field (a proxy's merge of two headers); send one key, or quote a key that holds a comma".into(),
            ));
        }
        text.to_owned()
    };
    check(&key, max_len)?;
    Ok(Some(key))
}

/// Parses an RFC 8941 String: `"`, printable ASCII with `\"` and `\\` escaped, `"`, nothing
/// after (parameters are not taken).
fn sf_string(value: &[u8]) -> Result<String, KeyError> {
    let mut key = String::with_capacity(value.len());
    let mut bytes = value[1..].iter();
    loop {
        match bytes.next() {
            None => {
                return Err(KeyError::Invalid(
                    "its quoted string has no closing quote".into(),
                ));
            }
            Some(b'"') => break,
            Some(b'\\') => match bytes.next() {
                Some(&c @ (b'"' | b'\\')) => key.push(c as char),
                _ => {
                    return Err(KeyError::Invalid(
                        "a backslash in its quoted string escapes something other than \" or \\"
                            .into(),
                    ));
                }
            },
            // Control and non-ASCII characters are refused by `check`, for every form.
            Some(&c) => key.push(c as char),
        }
    }
    if bytes.next().is_some() {
        return Err(KeyError::Invalid(
            "something follows its closing quote (parameters are not taken)".into(),
        ));
    }
    Ok(key)
}

fn check(key: &str, max_len: usize) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Invalid("it is empty".into()));
    }
    if key.len() > max_len {
        return Err(KeyError::Invalid(format!(
            "it is {} bytes long; keys are at most {max_len}",
            key.len()
        )));
    }
    if !key.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(KeyError::Invalid(
            "it holds a control or non-ASCII character".into(),
        ));
    }
    if key.starts_with(' ') || key.ends_with(' ') {
        return Err(KeyError::Invalid("it begins or ends with a space".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderValue, Request};
    use proptest::prelude::*;

    fn parts(values: &[&[u8]]) -> Parts {
        let mut request = Request::builder().method("POST").uri("/");
        for v in values {
            request = request.header(IDEMPOTENCY_KEY, HeaderValue::from_bytes(v).unwrap());
        }
        request.body(()).unwrap().into_parts().0
    }

    fn read(form: KeyForm, values: &[&[u8]]) -> Result<Option<String>, KeyError> {
        KeySource::idempotency_key(form).read(&parts(values), &Bytes::new(), 255)
    }

    #[test]
    fn a_comma_is_a_key_s_only_inside_quotes() {
        assert_eq!(read(KeyForm::Either, &[b"\"a,b\""]), Ok(Some("a,b".into())));
        assert!(read(KeyForm::Bare, &[b"a,b"]).is_err());
    }

    #[test]
    fn the_quoted_and_the_bare_spelling_are_one_key() {
        assert_eq!(read(KeyForm::Either, &[b"abc-1"]), Ok(Some("abc-1".into())));
        assert_eq!(
            read(KeyForm::Either, &[b"\"abc-1\""]),
            Ok(Some("abc-1".into()))
        );
        assert_eq!(
            read(KeyForm::Either, &[b"  \"abc-1\" "]),
            Ok(Some("abc-1".into()))
        );
        assert_eq!(
            read(KeyForm::Either, &[br#""a\"b\\c""#]),
            Ok(Some(r#"a"b\c"#.into()))
        );
        assert_eq!(read(KeyForm::Either, &[]), Ok(None));
    }

    #[test]
    fn each_form_alone_refuses_the_other_saying_which_it_takes() {
        let err = read(KeyForm::Bare, &[b"\"abc\""]).unwrap_err();
        assert!(err.to_string().contains("bare form"), "{err}");
        assert_eq!(read(KeyForm::Bare, &[b"abc"]), Ok(Some("abc".into())));
        let err = read(KeyForm::Quoted, &[b"abc"]).unwrap_err();
        assert!(err.to_string().contains("Structured Field"), "{err}");
        assert_eq!(read(KeyForm::Quoted, &[b"\"abc\""]), Ok(Some("abc".into())));
    }

    #[test]
    fn malformed_keys_are_refused_with_the_reason() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "empty"),
            (b"\"\"", "empty"),
            (b"\"abc", "no closing quote"),
            (b"\"ab\\nc\"", "backslash"),
            (b"\"abc\";p=1", "follows its closing quote"),
            (b"\"ab\tc\"", "control"),
            (b"ab\tc", "control"),
            (b"caf\xc3\xa9", "ASCII"),
            (b"\"caf\xc3\xa9\"", "non-ASCII"),
            (b"\" abc\"", "space"),
            (b"k1, k2", "comma"),
            (b"k1,k2", "two keys joined"),
            (b"\"k1\", \"k2\"", "follows its closing quote"),
        ];
        for (value, reason) in cases {
            let err = read(KeyForm::Either, &[value]).unwrap_err();
            assert!(err.to_string().contains(reason), "{value:?}: {err}");
        }
        assert_eq!(
            read(KeyForm::Either, &[b"a", b"b"]),
            Err(KeyError::Repeated)
        );
    }

    #[test]
    fn a_key_is_at_most_the_configured_length() {
        let long = "k".repeat(256);
        let err = KeySource::default()
            .read(&parts(&[long.as_bytes()]), &Bytes::new(), 255)
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("256 bytes long; keys are at most 255"),
            "{err}"
        );
        let fits = "k".repeat(255);
        assert_eq!(
            KeySource::default().read(&parts(&[fits.as_bytes()]), &Bytes::new(), 255),
            Ok(Some(fits))
        );
    }

    #[test]
    fn either_source_reads_the_first_that_finds_a_key_and_refuses_what_the_first_finds_malformed() {
        let source = KeySource::header(HeaderName::from_static("webhook-id"))
            .or(KeySource::json_pointer("/id"));
        assert!(source.needs_body());
        assert!(
            !KeySource::header(HeaderName::from_static("a"))
                .or(KeySource::header(HeaderName::from_static("b")))
                .needs_body()
        );
        let head = |value: Option<&[u8]>| {
            let mut request = Request::builder();
            if let Some(value) = value {
                request = request.header("webhook-id", HeaderValue::from_bytes(value).unwrap());
            }
            request.body(()).unwrap().into_parts().0
        };
        let body = Bytes::from_static(br#"{"id":"evt_body"}"#);
        assert_eq!(
            source.read(&head(Some(b"msg_header")), &body, 255),
            Ok(Some("msg_header".into()))
        );
        assert_eq!(
            source.read(&head(None), &body, 255),
            Ok(Some("evt_body".into()))
        );
        assert_eq!(source.read(&head(None), &Bytes::new(), 255), Ok(None));
        assert!(
            source.read(&head(Some(b" ")), &body, 255).is_err(),
            "a malformed header is refused, not passed over for the body's key"
        );
        assert_eq!(
            format!("{source:?}"),
            r#"Or(Header("webhook-id"), JsonPointer("/id"))"#
        );
    }

    #[test]
    fn other_sources_read_a_header_a_json_field_or_a_function() {
        let request = Request::builder()
            .header("x-github-delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958")
            .body(())
            .unwrap();
        let (parts, ()) = request.into_parts();
        let none = Bytes::new();
        let header = KeySource::header(HeaderName::from_static("x-github-delivery"));
        assert_eq!(
            header.read(&parts, &none, 255),
            Ok(Some("72d3162e-cc78-11e3-81ab-4c9367dc0958".into()))
        );
        assert!(!header.needs_body());

        let json = KeySource::json_pointer("/event/id");
        assert!(json.needs_body());
        let body = Bytes::from_static(br#"{"event":{"id":"evt_1"}}"#);
        assert_eq!(json.read(&parts, &body, 255), Ok(Some("evt_1".into())));
        let body = Bytes::from_static(br#"{"event":{"id":42}}"#);
        assert_eq!(json.read(&parts, &body, 255), Ok(Some("42".into())));
        assert_eq!(
            json.read(&parts, &Bytes::from_static(b"not json"), 255),
            Ok(None)
        );
        let body = Bytes::from_static(b"{\"event\":{\"id\":\"a\\u0000b\"}}");
        assert!(
            json.read(&parts, &body, 255).is_err(),
            "a key from the body is checked too"
        );

        let f = KeySource::from_fn(|_, body| {
            if body.is_empty() {
                Err("no body".into())
            } else {
                Ok(Some("f".into()))
            }
        });
        assert_eq!(
            f.read(&parts, &Bytes::from_static(b"x"), 255),
            Ok(Some("f".into()))
        );
        assert_eq!(
            f.read(&parts, &none, 255),
            Err(KeyError::Invalid("no body".into()))
        );
        assert_eq!(format!("{f:?}"), "Fn(..)");
    }

    proptest! {
        #[test]
        fn any_header_value_gives_a_key_or_a_reason_and_never_panics(value in proptest::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(header) = HeaderValue::from_bytes(&value) {
                let mut p = parts(&[]);
                p.headers.insert(IDEMPOTENCY_KEY, header);
                if let Ok(Some(key)) = KeySource::default().read(&p, &Bytes::new(), 255) {
                    prop_assert!(!key.is_empty() && key.len() <= 255);
                    prop_assert!(key.bytes().all(|b| (0x20..0x7f).contains(&b)));
                }
            }
        }

        #[test]
        fn every_valid_key_reads_the_same_bare_and_quoted(key in "[!-~]([ -~]{0,60}[!-~])?") {
            let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
            prop_assert_eq!(read(KeyForm::Either, &[quoted.as_bytes()]), Ok(Some(key.clone())));
            if !key.starts_with('"') && !key.contains(',') {
                prop_assert_eq!(read(KeyForm::Either, &[key.as_bytes()]), Ok(Some(key.clone())));
            }
        }
    }
}
