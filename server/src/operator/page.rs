//! The operator's page: the tally and the records by standing, with the forms that retry and
//! abandon them (each posting back, then sent to the page again).

use std::collections::HashMap;
use std::fmt::Write as _;

use axum::extract::{OriginalUri, State};
use axum::http::{HeaderValue, header};
use axum::response::{Html, IntoResponse, Redirect, Response};

use super::{OperatorView, failed, named, problem, unnamed};
use crate::store::{Operations, RecordView, Standing};
use axum::http::StatusCode;

/// The page's own path, from the path a form posted to (`/ops/retry` → `/ops`).
fn page_of(uri: &OriginalUri, action: &str) -> String {
    let path = uri.path();
    let base = path.strip_suffix(action).unwrap_or(path);
    if base.is_empty() {
        "/".to_owned()
    } else {
        base.to_owned()
    }
}

pub(super) async fn retry_form<S>(
    State(view): State<OperatorView<S>>,
    uri: OriginalUri,
    axum::Form(form): axum::Form<HashMap<String, String>>,
) -> Response
where
    S: Operations + Clone + Send + Sync + 'static,
{
    let Some((scope, key)) = named(&form) else {
        return unnamed();
    };
    match view.retry(scope, key).await {
        Ok(_) => Redirect::to(&page_of(&uri, "/retry")).into_response(),
        Err(error) => failed(&error),
    }
}

pub(super) async fn abandon_form<S>(
    State(view): State<OperatorView<S>>,
    uri: OriginalUri,
    axum::Form(form): axum::Form<HashMap<String, String>>,
) -> Response
where
    S: Operations + Clone + Send + Sync + 'static,
{
    let Some((scope, key)) = named(&form) else {
        return unnamed();
    };
    let reason = form.get("reason").map_or("", |r| r.trim());
    if reason.is_empty() {
        return problem(StatusCode::BAD_REQUEST, "say why the record is abandoned");
    }
    match view.abandon(scope, key, reason).await {
        Ok(_) => Redirect::to(&page_of(&uri, "/abandon")).into_response(),
        Err(error) => failed(&error),
    }
}

pub(super) async fn page<S>(State(view): State<OperatorView<S>>, uri: OriginalUri) -> Response
where
    S: Operations + Clone + Send + Sync + 'static,
{
    let base = uri.path().trim_end_matches('/').to_owned();
    let tally = match view.store.tally().await {
        Ok(tally) => tally,
        Err(error) => return failed(&error),
    };
    let mut html = String::from(concat!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>Idempotency records</title>",
        "<style>body{font:14px system-ui,sans-serif;margin:2em;color:#222}",
        "table{border-collapse:collapse;margin-bottom:2em}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}",
        "th{background:#f4f4f4}.tally span{display:inline-block;margin-right:1.5em}code{font-size:12px}",
        "form{display:inline}</style></head><body><h1>Idempotency records</h1><p class=\"tally\">"
    ));
    for standing in Standing::ALL {
        let _ = write!(
            html,
            "<span id=\"tally-{name}\">{name}: <b>{n}</b></span>",
            name = standing.name(),
            n = tally.of(standing)
        );
    }
    html.push_str("</p>");
    for standing in [
        Standing::Parked,
        Standing::Stalled,
        Standing::Failed,
        Standing::Running,
    ] {
        let records = match view.store.records(standing, view.limit).await {
            Ok(records) => records,
            Err(error) => return failed(&error),
        };
        let _ = write!(
            html,
            "<h2>{}</h2><table id=\"{}\"><tr><th>scope</th><th>key</th><th>step</th><th>steps</th>\
             <th>request</th><th>starts</th><th>created</th><th>lease ends</th><th>retention ends</th>\
             <th>note</th><th></th></tr>",
            escape(standing.name()),
            standing.name()
        );
        if records.is_empty() {
            html.push_str("<tr><td colspan=\"11\">none</td></tr>");
        }
        for record in &records {
            row(&mut html, &base, record);
        }
        html.push_str("</table>");
    }
    html.push_str("</body></html>");
    let mut answer = Html(html).into_response();
    answer
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    answer
}

fn row(html: &mut String, base: &str, record: &RecordView) {
    let hidden = format!(
        "<input type=\"hidden\" name=\"scope\" value=\"{}\"><input type=\"hidden\" name=\"key\" value=\"{}\">",
        escape(&record.scope),
        escape(&record.key)
    );
    let request = record
        .request
        .as_ref()
        .map(|(m, t)| format!("{m} {t}"))
        .unwrap_or_default();
    let _ = write!(
        html,
        "<tr data-key=\"{key}\"><td>{scope}</td><td><code>{key}</code></td><td>{step}</td><td><code>{steps}</code></td>\
         <td>{request}</td><td>{starts}</td><td>{created}</td><td>{lease}</td><td>{expires}</td><td>{note}</td><td>",
        scope = escape(&record.scope),
        key = escape(&record.key),
        step = escape(record.step.as_deref().unwrap_or("")),
        steps = escape(record.steps.as_deref().unwrap_or("")),
        request = escape(&request),
        starts = record.starts,
        created = time_of(record.created_at_ms),
        lease = record.lease_ends_ms.map(time_of).unwrap_or_default(),
        expires = time_of(record.expires_at_ms),
        note = escape(record.note.as_deref().unwrap_or("")),
    );
    if matches!(record.standing, Standing::Parked | Standing::Stalled) {
        let _ = write!(
            html,
            "<form method=\"post\" action=\"{base}/retry\">{hidden}<button class=\"retry\">retry now</button></form> "
        );
    }
    if matches!(
        record.standing,
        Standing::Parked | Standing::Stalled | Standing::Failed
    ) {
        let _ = write!(
            html,
            "<form method=\"post\" action=\"{base}/abandon\">{hidden}<input name=\"reason\" placeholder=\"why\" required>\
             <button class=\"abandon\">abandon</button></form>"
        );
    }
    html.push_str("</td></tr>");
}

/// Text made safe inside HTML, attributes included.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Milliseconds since the Unix epoch as RFC 3339 in UTC (`2026-12-06T08:15:00.123Z`).
pub(super) fn time_of(ms: i64) -> String {
    let (days, in_day) = (ms.div_euclid(86_400_000), ms.rem_euclid(86_400_000));
    // Days to a civil date (proleptic Gregorian), after Howard Hinnant's `civil_from_days`.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s, milli) = (
        in_day / 3_600_000,
        in_day / 60_000 % 60,
        in_day / 1000 % 60,
        in_day % 1000,
    );
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{milli:03}Z")
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::extract::OriginalUri;

    #[test]
    fn times_read_as_rfc_3339_in_utc() {
        assert_eq!(time_of(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(time_of(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(time_of(1_796_545_800_123), "2026-12-06T08:30:00.123Z");
        assert_eq!(time_of(-1), "1969-12-31T23:59:59.999Z");
    }

    #[test]
    fn text_is_escaped_for_html_and_its_attributes() {
        assert_eq!(
            escape("<a href=\"x\">'&'</a>"),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
    }

    #[test]
    fn a_form_s_page_is_its_action_s_parent() {
        let uri = |path: &str| OriginalUri(path.parse().unwrap());
        assert_eq!(page_of(&uri("/ops/retry"), "/retry"), "/ops");
        assert_eq!(page_of(&uri("/retry"), "/retry"), "/");
    }
}
