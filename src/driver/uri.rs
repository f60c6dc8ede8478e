//! A request of the tower or gRPC door named by its URI: its URL's text as the reqwest door's
//! `Url` writes it, for the fingerprint that knows a request across the three doors (one rule:
//! the same request, however written, gives the same fingerprint at every door).

/// [`fingerprint_of`](crate::driver::claim::fingerprint_of) a request of `method` to `uri`, of
/// the URL's text in its canonical form, the URL standard's, as `Url::as_str` writes it
/// (`scheme://authority/path?query`), so that the reqwest door, which fingerprints its `Url`,
/// gives the same for the same request however it was written.
///
/// Most URIs are written canonically already (a lower-case host name or a dotted IPv4 address,
/// a port without leading zeros, a path and query with nothing the standard escapes or
/// resolves): their text is taken from the URI's parts in place, less the scheme's own port
/// and with `/` for an empty path, without parsing them again (this runs for every request).
/// Any other is parsed as a `Url` and its text taken.
pub(crate) fn fingerprint(method: &http::Method, uri: &http::Uri) -> u64 {
    // A path alone (a gRPC call without an origin, as tonic's generated clients send it):
    // nothing to write in the URL standard's form, and nothing to allocate.
    if uri.scheme().is_none() && uri.authority().is_none() {
        let path_and_query = uri.path_and_query().map_or("/", |pq| pq.as_str());
        return crate::driver::claim::fingerprint_of(method, path_and_query.as_bytes());
    }
    if !canonical(uri) {
        if let Ok(url) = url::Url::parse(&uri.to_string()) {
            let text = url.as_str();
            let end = text.find('#').unwrap_or(text.len());
            return crate::driver::claim::fingerprint_of(method, &text.as_bytes()[..end]);
        }
    }
    let scheme = uri.scheme_str().unwrap_or("");
    let written = uri.authority().map_or("", |authority| authority.as_str());
    let own_port = match scheme {
        "http" => written.strip_suffix(":80"),
        "https" => written.strip_suffix(":443"),
        _ => None,
    };
    let authority = own_port.unwrap_or(written);
    let path_and_query = uri.path_and_query().map_or("/", |pq| pq.as_str());
    // A query after an empty path: the URL writes the path as `/`.
    let slash = if path_and_query.starts_with('?') {
        "/"
    } else {
        ""
    };
    let pieces = [
        scheme.as_bytes(),
        b"://",
        authority.as_bytes(),
        slash.as_bytes(),
        path_and_query.as_bytes(),
    ];
    // Written out on the stack (a longer URL, rare, on the heap), and folded in one piece.
    let mut stack = [0u8; 256];
    if let Some(text) = joined(&mut stack, &pieces) {
        return crate::driver::claim::fingerprint_of(method, text);
    }
    let mut heap = vec![0u8; pieces.iter().map(|piece| piece.len()).sum()];
    let text = joined(&mut heap, &pieces).unwrap_or_default();
    crate::driver::claim::fingerprint_of(method, text)
}

/// Whether `uri` is written as the URL standard writes it, as far as a cheap look can tell
/// (it may say no to a URI that is: the caller then parses it): an `http` or `https` URI whose
/// authority is a lower-case host name or a dotted IPv4 address without leading zeros, with no
/// user name and a port without leading zeros, and whose path and query hold no byte the
/// standard escapes or reads otherwise, and no dot segment. One pass over each part's bytes,
/// each byte's class read from a table: this runs for every request.
fn canonical(uri: &http::Uri) -> bool {
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return false;
    }
    let Some(authority) = uri.authority() else {
        return false;
    };
    let path_and_query = uri.path_and_query().map_or("", |pq| pq.as_str());
    canonical_authority(authority.as_str().as_bytes())
        && canonical_path_and_query(path_and_query.as_bytes())
}

/// A byte of a host name as [`canonical_authority`] reads it.
const OTHER: u8 = 0;
const LETTER: u8 = 1;
const DIGIT: u8 = 2;
const DOT: u8 = 3;
const DASH: u8 = 4;

/// The class of every byte in a host name: a lower-case letter, a digit, a dot, a dash, or
/// anything else (which the parser is left to read).
static HOST: [u8; 256] = {
    let mut table = [OTHER; 256];
    let mut byte = 0;
    while byte < 256 {
        table[byte] = match byte as u8 {
            b'a'..=b'z' => LETTER,
            b'0'..=b'9' => DIGIT,
            b'.' => DOT,
            b'-' => DASH,
            _ => OTHER,
        };
        byte += 1;
    }
    table
};

/// A lower-case host name, or a dotted IPv4 address of four numbers up to 255 without leading
/// zeros, then a port of digits without a leading zero; not an IPv6 address (the standard
/// shortens them), a user name, or an IDNA label (`xn--`).
fn canonical_authority(authority: &[u8]) -> bool {
    // The port is the digits after the last colon; a colon of a user name or an IPv6 address
    // leaves a host the loop below refuses.
    let (host, port) = match authority.iter().rposition(|b| *b == b':') {
        Some(at) => (&authority[..at], Some(&authority[at + 1..])),
        None => (authority, None),
    };
    let port_plain = port.is_none_or(|port| {
        !port.is_empty() && port.iter().all(u8::is_ascii_digit) && (port == b"0" || port[0] != b'0')
    });
    if host.is_empty() || !port_plain {
        return false;
    }
    // The current label's start and whether it is all digits, and how many dots came before.
    let (mut dots, mut start, mut digits) = (0, 0, true);
    for (at, byte) in host.iter().enumerate() {
        match HOST[usize::from(*byte)] {
            LETTER => digits = false,
            DIGIT => {}
            // An IDNA label: the standard checks and may rewrite it.
            DASH if at >= 3 && host[at - 3..at] == *b"xn-" => return false,
            DASH => digits = false,
            // An empty label (a leading dot, two dots) is left to the parser.
            DOT if at == start => return false,
            DOT => (dots, start, digits) = (dots + 1, at + 1, true),
            _ => return false,
        }
    }
    // The last label (before a final dot, if any) decides whether the standard reads an IPv4
    // address: a number, or `0x`...
    let last = &host[start..];
    let (last, dotted) = if last.is_empty() {
        let before = host[..host.len() - 1]
            .rsplit(|b| *b == b'.')
            .next()
            .unwrap_or(b"");
        (before, false)
    } else {
        (last, true)
    };
    let numeric = (digits && !last.is_empty() && dotted)
        || last.starts_with(b"0x")
        || (!dotted && last.iter().all(u8::is_ascii_digit));
    if !numeric {
        return true;
    }
    // An IPv4 address (rare in a request's URI, so read again here): four plain numbers.
    dotted && dots == 3 && host.split(|b| *b == b'.').all(plain_number)
}

/// A decimal number up to 255 without a leading zero.
fn plain_number(digits: &[u8]) -> bool {
    !digits.is_empty()
        && digits.len() <= 3
        && digits.iter().all(u8::is_ascii_digit)
        && (digits == b"0" || digits[0] != b'0')
        && digits
            .iter()
            .fold(0u32, |n, d| n * 10 + u32::from(d - b'0'))
            <= 255
}

/// A byte of a path or query as [`canonical_path_and_query`] reads it.
const PLAIN: u8 = 0;
const LOOK: u8 = 1;
const ESCAPED: u8 = 2;

/// The class of every byte in a path and query: one the standard keeps as it is, one whose
/// reading depends on where it stands (`.` and `%` after a `/`, `'` in the query, `?`),
/// or one it escapes or reads otherwise wherever it stands (space, control and non-ASCII
/// bytes, `"`, `#`, `<`, `>`, `` ` ``, `{`, `}`, `^`, `\`).
static PATH: [u8; 256] = {
    let mut table = [ESCAPED; 256];
    let mut byte = 0;
    while byte < 256 {
        table[byte] = match byte as u8 {
            b'.' | b'%' | b'\'' | b'?' => LOOK,
            b'"' | b'#' | b'<' | b'>' | b'`' | b'{' | b'}' | b'^' | b'\\' => ESCAPED,
            b'!'..=b'~' => PLAIN,
            _ => ESCAPED,
        };
        byte += 1;
    }
    table
};

/// A path and query with no byte the standard escapes (in a path: space, `"`, `#`, `<`, `>`,
/// `` ` ``, `{`, `}`, `^`; in a query also `'`), reads as another (`\`), or resolves (a segment
/// that starts with `.` or `%2e`).
fn canonical_path_and_query(path_and_query: &[u8]) -> bool {
    for (at, byte) in path_and_query.iter().enumerate() {
        match PATH[usize::from(*byte)] {
            PLAIN => {}
            ESCAPED => return false,
            // From the query on, only a byte the standard escapes there matters (`'` too).
            _ if *byte == b'?' => {
                return path_and_query[at + 1..]
                    .iter()
                    .all(|b| PATH[usize::from(*b)] != ESCAPED && *b != b'\'');
            }
            _ if *byte == b'\'' => {}
            // `.` or `%`: a dot segment starts after a `/` with `.` or `%2e`.
            _ => {
                let after_slash = at > 0 && path_and_query[at - 1] == b'/';
                let dot = *byte == b'.'
                    || path_and_query
                        .get(at + 1..at + 3)
                        .is_some_and(|two| two.eq_ignore_ascii_case(b"2e"));
                if after_slash && dot {
                    return false;
                }
            }
        }
    }
    true
}

/// `pieces` one after another at the start of `out`, if they fit.
fn joined<'o>(out: &'o mut [u8], pieces: &[&[u8]]) -> Option<&'o [u8]> {
    let mut written = 0;
    for piece in pieces {
        let end = written + piece.len();
        out.get_mut(written..end)?.copy_from_slice(piece);
        written = end;
    }
    Some(&out[..written])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A path alone (a gRPC call without an origin) is named by its method and path, with no
    /// URL written (nothing allocated); one request written absolute is named as the reqwest
    /// door's `Url` writes it, whatever the door.
    #[test]
    fn a_path_alone_is_named_by_its_path_and_an_absolute_uri_by_its_url() {
        let post = http::Method::POST;
        let path: http::Uri = "/echo.Echo/Say".parse().unwrap();
        assert_eq!(
            fingerprint(&post, &path),
            crate::driver::claim::fingerprint_of(&post, b"/echo.Echo/Say")
        );
        let absolute: http::Uri = "HTTP://Ledger.Example:80/echo.Echo/Say".parse().unwrap();
        assert_eq!(
            fingerprint(&post, &absolute),
            crate::driver::claim::fingerprint_of(&post, b"http://ledger.example/echo.Echo/Say")
        );
        assert_ne!(fingerprint(&post, &path), fingerprint(&post, &absolute));
    }
    use crate::engine::seen::split_authority;

    proptest::proptest! {
        /// The host and port read in one pass are those `http` reads, for any authority it
        /// parses: names, IPv4 and IPv6 addresses, user info, ports in and out of range.
        #[test]
        fn the_host_and_port_are_those_http_reads(
            user in proptest::option::of("[a-z0-9:]{0,6}"),
            host in concat!(
                "[a-z0-9.-]{1,12}|\\[[0-9a-f:]{2,12}\\]",
                "|[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}",
            ),
            port in proptest::option::of("\\+?[0-9]{0,7}"),
        ) {
            let mut text = String::new();
            if let Some(user) = user {
                text.push_str(&user);
                text.push('@');
            }
            text.push_str(&host);
            if let Some(port) = port {
                text.push(':');
                text.push_str(&port);
            }
            let Ok(uri) = format!("http://{text}/x").parse::<http::Uri>() else {
                return Ok(());
            };
            let authority = uri.authority().unwrap().as_str();
            proptest::prop_assert_eq!(
                split_authority(authority),
                (uri.host().unwrap(), uri.port_u16()),
                "{}", authority
            );
        }
    }

    /// A URI as a user may write it: each part canonical or not.
    fn written_uri() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let scheme = prop::sample::select(vec!["http", "https", "HTTP", "Https"]);
        let host = prop::sample::select(vec![
            "example.com",
            "Example.COM",
            "api.test",
            "a-b.test.",
            "127.0.0.1",
            "127.000.0.1",
            "127.1",
            "0x7f.0.0.1",
            "10.0.0.256",
            "[::1]",
            "[0:0:0:0:0:0:0:1]",
            "[::FFFF:1.2.3.4]",
            "[2001:DB8::1]",
            "user:pw@h.test",
            "xn--nxasmq6b.test",
            "a..b.test",
            "1.2.3.4.",
            "123",
            "a.123",
            "foo.0x1",
            "h.test.",
            "1a.test",
        ]);
        let port = prop::sample::select(vec!["", ":80", ":443", ":080", ":8080", ":0", ":00", ":"]);
        let segment = prop::sample::select(vec![
            "a", "B", "{x}", "`t`", "..", ".", "%2e", "%2E%2e", "~", "a.b", "%7e", "%7E", "^", "|",
            "'", "\"q\"", "a%20b", "",
        ]);
        let path = prop::collection::vec(segment, 0..4);
        let query = proptest::option::of(prop::collection::vec(
            prop::sample::select(vec![
                "a=1", "'x'", "\"y\"", "{z}", "`", "b=^", "c=%41", "&", "=",
            ]),
            0..3,
        ));
        (scheme, host, port, path, query).prop_map(|(scheme, host, port, path, query)| {
            let mut text = format!("{scheme}://{host}{port}");
            for segment in path {
                text.push('/');
                text.push_str(segment);
            }
            if let Some(query) = query {
                text.push('?');
                text.push_str(&query.concat());
            }
            text
        })
    }

    proptest::proptest! {
        /// A request has one fingerprint behind either door, however its target was written:
        /// the tower door's, of the URI, equals the reqwest door's, of the `Url` the same text
        /// makes (upper-case hosts, short and long IP addresses, leading zeros in a port, dot
        /// segments, characters the URL standard escapes in a path or a query).
        #[test]
        fn both_doors_give_one_fingerprint_for_any_way_of_writing_a_target(written in written_uri()) {
            let Ok(uri) = written.parse::<http::Uri>() else {
                return Ok(());
            };
            let Ok(url) = reqwest::Url::parse(&uri.to_string()) else {
                return Ok(());
            };
            let method: http::Method = "POST".parse().unwrap();
            let reqwest = reqwest::Request::new(method.clone(), url.clone());
            proptest::prop_assert_eq!(
                fingerprint(&method, &uri),
                crate::driver::claim::fingerprint(&reqwest),
                "{} is {}", written, url
            );
        }
    }

    /// The cases the doors used to write apart, each once.
    #[test]
    fn targets_the_two_doors_wrote_apart_now_have_one_fingerprint() {
        for written in [
            "http://EXAMPLE.com/a",
            "http://h.test/{x}",
            "http://h.test/a/../b/./c",
            "http://127.1/a",
            "http://0x7f.0.0.1/a",
            "http://h.test/a?q='x'",
            "http://h.test:080/a",
            "http://[0:0:0:0:0:0:0:1]:8080/a",
        ] {
            let uri: http::Uri = written.parse().unwrap();
            let url = reqwest::Url::parse(written).unwrap();
            assert!(!canonical(&uri), "{written}");
            let get: http::Method = "GET".parse().unwrap();
            let reqwest = reqwest::Request::new(get.clone(), url);
            assert_eq!(
                fingerprint(&get, &uri),
                crate::driver::claim::fingerprint(&reqwest),
                "{written}"
            );
        }
        assert!(canonical(
            &"http://127.0.0.1:8080/orders?id=7".parse().unwrap()
        ));
        assert!(canonical(
            &"https://api.example.com/a/b.c?x=1&y=%41".parse().unwrap()
        ));
        // A host name with its final dot is canonical as it is; an empty label is left to the
        // parser, as is an IPv4 address with a final dot (the standard drops it).
        assert!(canonical(&"http://h.test./a".parse().unwrap()));
        assert!(!canonical(&"http://a..b.test/a".parse().unwrap()));
        assert!(!canonical(&"http://1.2.3.4./a".parse().unwrap()));
        // A number over 255 is no IPv4 part; an escape inside a path segment stays as written.
        assert!(!canonical(&"http://10.0.0.256/a".parse().unwrap()));
        assert!(canonical(&"http://h.test/a%41b/c%2e".parse().unwrap()));
    }

    /// The quick look says yes to what the standard writes as it is and no to what it may
    /// rewrite, byte class by byte class: each of these is written as given by the reqwest
    /// door's `Url` too, and the look must not send it to the parser (nor a rewritten one past
    /// it).
    #[test]
    fn the_quick_look_knows_each_class_of_byte() {
        let get: http::Method = "GET".parse().unwrap();
        for written in [
            // A dash in a host name; an `x` and dashes that are no IDNA prefix.
            "http://api-v2.example.com/a",
            "http://x-n--a.test/a",
            "http://a-.b-c.test/a",
            // A `'` in a path (escaped only in a query), even after a `/` and before `2e`.
            "http://h.test/'2e/it's",
            // A plain byte after a `/`, then `2e`: no dot segment.
            "http://h.test/x2e",
            // In a query, dots and escapes of dots are plain.
            "http://h.test/a?./%2e",
        ] {
            let uri: http::Uri = written.parse().unwrap();
            assert!(canonical(&uri), "{written}");
            let url = reqwest::Url::parse(written).unwrap();
            assert_eq!(url.as_str(), written, "the standard writes it as it is");
            assert_eq!(
                fingerprint(&get, &uri),
                crate::driver::claim::fingerprint(&reqwest::Request::new(get.clone(), url)),
            );
        }
        // An IDNA label, which the standard checks and may rewrite, is left to the parser.
        assert!(!canonical(&"http://xn--nxasmq6b.test/a".parse().unwrap()));
        assert!(!canonical(&"http://a.xn--nxasmq6b/a".parse().unwrap()));
    }

    #[test]
    fn a_long_url_is_written_on_the_heap_and_one_that_does_not_fit_not_at_all() {
        let long = format!("http://127.0.0.1:8080/{}", "a".repeat(300));
        let uri: http::Uri = long.parse().unwrap();
        let url: reqwest::Url = long.parse().unwrap();
        let method: http::Method = "GET".parse().unwrap();
        assert_eq!(
            fingerprint(&method, &uri),
            crate::driver::claim::fingerprint_of(&method, url.as_str().as_bytes())
        );
        let mut room = [0u8; 5];
        assert_eq!(joined(&mut room, &[b"ab", b"cde"]), Some(&b"abcde"[..]));
        assert_eq!(joined(&mut room, &[b"ab", b"cdef"]), None);
    }
}
