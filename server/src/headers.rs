//! Which headers a stored answer or a saved request keeps, and the replay marker.

use http::header::{self, HeaderName, HeaderValue};

/// The header a replay carries, which this workspace's client reads.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The headers a replay sends again: all but the hop-by-hop ones (and those a `Connection`
/// header names), and `content-length`, which the stored body sets again.
pub(crate) fn end_to_end(headers: &http::HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    const HOP: [HeaderName; 8] = [
        header::CONNECTION,
        HeaderName::from_static("keep-alive"),
        header::PROXY_AUTHENTICATE,
        header::PROXY_AUTHORIZATION,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ];
    let named: Vec<&str> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .collect();
    headers
        .iter()
        .filter(|(name, _)| {
            !HOP.contains(name)
                && *name != header::CONTENT_LENGTH
                && !named.iter().any(|n| n.eq_ignore_ascii_case(name.as_str()))
        })
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_not_stored() {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("close, X-Private"),
        );
        headers.insert("x-private", HeaderValue::from_static("1"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("2"));
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.append("set-cookie", HeaderValue::from_static("a=1"));
        headers.append("set-cookie", HeaderValue::from_static("b=2"));
        let kept = end_to_end(&headers);
        let names: Vec<_> = kept
            .iter()
            .map(|(n, v)| format!("{n}: {}", v.to_str().unwrap()))
            .collect();
        assert_eq!(
            names,
            [
                "content-type: application/json",
                "set-cookie: a=1",
                "set-cookie: b=2"
            ]
        );
    }
}
