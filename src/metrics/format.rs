//! The two exposition formats of `GET /metrics`: OpenMetrics (what Prometheus asks for) and
//! the older text format, made from it.

/// The two exposition formats of `GET /metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0: what Prometheus asks for first.
    OpenMetrics,
    /// The Prometheus text format 0.0.4: for whoever does not ask for OpenMetrics (curl,
    /// older scrapers, and `promtool check metrics`, which reads only this one).
    Text,
}

impl Format {
    /// OpenMetrics when the `Accept` header names it, else the text format (the Go
    /// client's rule).
    pub fn negotiate(accept: Option<&str>) -> Format {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::Text,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Text => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

/// OpenMetrics text as the 0.0.4 text format: the samples are the same; a counter's `HELP`
/// and `TYPE` lines name it as its samples do (`_total`), and there is no `# EOF` (nor
/// `# UNIT`, which this registry never writes).
pub(super) fn openmetrics_to_text(open: &str) -> String {
    let counters: std::collections::HashSet<&str> = open
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open.len());
    for line in open.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let total = if counters.contains(name) {
                    "_total"
                } else {
                    ""
                };
                out.push_str(&format!("{prefix}{name}{total} {tail}"));
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}
