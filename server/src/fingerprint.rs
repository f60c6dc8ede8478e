//! The request fingerprint: what makes a second request with one key "the same request".

use bytes::Bytes;
use http::HeaderName;
use http::request::Parts;
use sha2::{Digest, Sha256};

/// What goes into a request's fingerprint.
///
/// Always the method, the path with its query, and the body. The body is taken byte for byte,
/// or with [`canonical_json`](Fingerprint::canonical_json) as JSON whose objects' keys are
/// sorted and whose whitespace is gone, so that a client that re-serialises its payload on a
/// retry is not refused. Headers go in only when named.
#[derive(Debug, Clone, Default)]
pub struct Fingerprint {
    canonical_json: bool,
    headers: Vec<HeaderName>,
}

impl Fingerprint {
    /// The default: method, path and query, and the body's bytes.
    pub fn new() -> Fingerprint {
        Fingerprint::default()
    }

    /// Reads a JSON body as JSON: key order and whitespace do not change the fingerprint. A
    /// body that is not JSON is taken byte for byte. Off by default.
    pub fn canonical_json(mut self, on: bool) -> Fingerprint {
        self.canonical_json = on;
        self
    }

    /// Adds a header to the fingerprint (its values in order; absent and empty differ).
    pub fn header(mut self, name: HeaderName) -> Fingerprint {
        self.headers.push(name);
        self
    }

    /// The SHA-256 of the request's parts, each prefixed by its length so that no two
    /// different requests run together into the same bytes.
    pub(crate) fn of(&self, parts: &Parts, body: &Bytes) -> [u8; 32] {
        let mut hash = Sha256::new();
        let mut part = |bytes: &[u8]| {
            hash.update((bytes.len() as u64).to_be_bytes());
            hash.update(bytes);
        };
        part(parts.method.as_str().as_bytes());
        part(
            parts
                .uri
                .path_and_query()
                .map_or("/", |p| p.as_str())
                .as_bytes(),
        );
        for name in &self.headers {
            part(name.as_str().as_bytes());
            let values: Vec<_> = parts.headers.get_all(name).iter().collect();
            part(&(values.len() as u64).to_be_bytes());
            for value in values {
                part(value.as_bytes());
            }
        }
        let canonical = self
            .canonical_json
            .then(|| serde_json::from_slice::<serde_json::Value>(body).ok())
            .flatten()
            .map(|json| {
                let mut out = Vec::with_capacity(body.len());
                write_canonical(&json, &mut out);
                out
            });
        match canonical {
            // A tag apart from raw bytes, so that a JSON body never collides with its own text.
            Some(json) => {
                part(b"json");
                part(&json);
            }
            None => {
                part(b"raw");
                part(body);
            }
        }
        hash.finalize().into()
    }
}

/// Writes JSON with objects' keys sorted, whatever map type serde_json was built with.
fn write_canonical(value: &serde_json::Value, out: &mut Vec<u8>) {
    use serde_json::Value;
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (key, value)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(serde_json::to_string(key).unwrap_or_default().as_bytes());
                out.push(b':');
                write_canonical(value, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        scalar => out.extend_from_slice(scalar.to_string().as_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn fp(
        f: &Fingerprint,
        method: &str,
        uri: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> [u8; 32] {
        let mut request = Request::builder().method(method).uri(uri);
        for (n, v) in headers {
            request = request.header(*n, *v);
        }
        let (parts, ()) = request.body(()).unwrap().into_parts();
        f.of(&parts, &Bytes::copy_from_slice(body.as_bytes()))
    }

    #[test]
    fn method_path_query_and_body_each_change_it() {
        let f = Fingerprint::new();
        let base = fp(&f, "POST", "/charges?a=1", &[], "{\"a\":1}");
        assert_eq!(
            base,
            fp(&f, "POST", "/charges?a=1", &[("x-other", "1")], "{\"a\":1}")
        );
        assert_ne!(base, fp(&f, "PATCH", "/charges?a=1", &[], "{\"a\":1}"));
        assert_ne!(base, fp(&f, "POST", "/charge?a=1", &[], "{\"a\":1}"));
        assert_ne!(base, fp(&f, "POST", "/charges?a=2", &[], "{\"a\":1}"));
        assert_ne!(base, fp(&f, "POST", "/charges?a=1", &[], "{\"a\":2}"));
        assert_ne!(
            base,
            fp(&f, "POST", "/charges?a=1", &[], "{\"a\": 1}"),
            "bytes by default"
        );
        // Lengths keep parts apart: "/a" + "b" is not "/ab" + "".
        assert_ne!(
            fp(&f, "POST", "/a", &[], "b"),
            fp(&f, "POST", "/ab", &[], "")
        );
    }

    #[test]
    fn canonical_json_ignores_order_and_whitespace_only() {
        let f = Fingerprint::new().canonical_json(true);
        let a = fp(&f, "POST", "/", &[], r#"{"b":[1,{"y":2,"x":1}],"a":"s"}"#);
        assert_eq!(
            a,
            fp(
                &f,
                "POST",
                "/",
                &[],
                "{ \"a\" : \"s\",\n \"b\": [1, {\"x\":1, \"y\":2}] }"
            )
        );
        assert_ne!(
            a,
            fp(&f, "POST", "/", &[], r#"{"b":[{"y":2,"x":1},1],"a":"s"}"#),
            "array order counts"
        );
        assert_ne!(
            a,
            fp(&f, "POST", "/", &[], r#"{"b":[1,{"y":2,"x":1}],"a":"t"}"#)
        );
        // Not JSON: bytes, and never equal to a JSON body with the same text.
        assert_ne!(
            fp(&f, "POST", "/", &[], "not json"),
            fp(&f, "POST", "/", &[], "not  json")
        );
        assert_ne!(
            fp(&f, "POST", "/", &[], "\"s\""),
            fp(&Fingerprint::new(), "POST", "/", &[], "\"s\"")
        );
    }

    #[test]
    fn the_canonical_form_is_sorted_compact_json_a_stable_contract() {
        // Stored fingerprints outlive a release: the canonical bytes must not change.
        let canonical = |text: &str| {
            let mut out = Vec::new();
            write_canonical(&serde_json::from_str(text).unwrap(), &mut out);
            String::from_utf8(out).unwrap()
        };
        assert_eq!(
            canonical(r#" { "b" : [1, {"y":2, "x":1}, []], "a":"s\"q", "c": {} } "#),
            r#"{"a":"s\"q","b":[1,{"x":1,"y":2},[]],"c":{}}"#
        );
        assert_eq!(canonical("[true,null,1.5,-2]"), "[true,null,1.5,-2]");
    }

    #[test]
    fn a_named_header_counts_its_values_and_their_absence() {
        let f = Fingerprint::new().header(HeaderName::from_static("x-account"));
        let none = fp(&f, "POST", "/", &[], "");
        assert_ne!(none, fp(&f, "POST", "/", &[("x-account", "")], ""));
        assert_ne!(
            fp(&f, "POST", "/", &[("x-account", "1")], ""),
            fp(&f, "POST", "/", &[("x-account", "2")], "")
        );
        assert_eq!(
            fp(&f, "POST", "/", &[("x-account", "1")], ""),
            fp(&f, "POST", "/", &[("x-account", "1")], "")
        );
    }
}
