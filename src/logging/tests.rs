use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use super::*;

/// The access line's fields, with values that need every kind of escaping.
fn emit_ours(format: LogFormat, client: &str, path: &str, error: &str) -> Vec<u8> {
    let client: std::net::IpAddr = client.parse().unwrap();
    let mut event = Event::new(format, false, "idemgate::access", "request");
    event
        .field(&field_name!("method"), Value::Plain("POST"))
        .field(&field_name!("path"), Value::Str(path))
        .field(&field_name!("client"), Value::Ip(client))
        .field(&field_name!("status"), Value::U64(201))
        .field(&field_name!("upstream_us"), Value::I64(-1))
        .field(&field_name!("bytes_out"), Value::U64(0))
        .field(&field_name!("error"), Value::Str(error));
    if format == LogFormat::Json {
        event.line.extend_from_slice(b",\"target\":");
        json_str(&mut event.line, event.target);
        event.line.push(b'}');
    }
    event.line.push(b'\n');
    event.line
}

/// The same event through `tracing-subscriber`'s own formatter.
fn emit_theirs(format: LogFormat, client: &str, path: &str, error: &str) -> Vec<u8> {
    #[derive(Clone)]
    struct Capture(Arc<Mutex<Vec<u8>>>);
    impl Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let out = Capture(Arc::new(Mutex::new(Vec::new())));
    let writer = out.clone();
    let builder = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone());
    let emit = || {
        let client: std::net::IpAddr = client.parse().unwrap();
        let (status, upstream_us, bytes_out) = (201u16, -1i64, 0u64);
        tracing::info!(
            target: "idemgate::access", method = "POST", path, %client, status, upstream_us,
            bytes_out, error, "request"
        );
    };
    match format {
        LogFormat::Text => tracing::subscriber::with_default(builder.finish(), emit),
        LogFormat::Json => {
            tracing::subscriber::with_default(builder.json().flatten_event(true).finish(), emit)
        }
    }
    out.0.lock().unwrap().clone()
}

/// Both lines without their timestamps (they were taken at different instants).
fn untimed(line: &[u8], format: LogFormat) -> String {
    let s = String::from_utf8(line.to_vec()).unwrap();
    let skip = match format {
        LogFormat::Text => 0,
        LogFormat::Json => "{\"timestamp\":\"".len(),
    };
    let len = "2026-12-01T03:07:02.345586Z".len();
    format!("{}{}", &s[..skip], &s[skip + len..])
}

#[test]
fn the_access_line_is_byte_for_byte_what_tracing_subscriber_would_write() {
    let cases = [
        ("/plain/pay", ""),
        ("/a\"b", "say \"no\""),
        ("/a\\b", "C:\\"),
        ("/a\"b\\c", "upstream said \"no\"\n\ttab"),
        ("/caf\u{e9}/\u{1}", "\u{7f} and \u{2028}"),
    ];
    let clients = [
        "2001:db8::1",
        "::ffff:192.0.2.7",
        "127.0.0.1",
        "0.0.0.0",
        "10.200.9.255",
    ];
    for format in [LogFormat::Text, LogFormat::Json] {
        for (path, error) in cases {
            for client in clients {
                let ours = emit_ours(format, client, path, error);
                let theirs = emit_theirs(format, client, path, error);
                assert_eq!(
                    untimed(&ours, format),
                    untimed(&theirs, format),
                    "{format:?} layout differs for client {client}, path {path:?}, error {error:?}"
                );
            }
        }
    }
}

#[test]
fn numbers_are_written_in_decimal_two_digits_at_a_time() {
    let write = |n: u64, negative: bool| {
        let mut line = Vec::new();
        decimal(&mut line, n, negative);
        String::from_utf8(line).unwrap()
    };
    for n in [
        0,
        1,
        9,
        10,
        11,
        99,
        100,
        101,
        999,
        1000,
        65_535,
        1_234_567,
        u64::MAX,
    ] {
        assert_eq!(write(n, false), n.to_string());
        assert_eq!(write(n, true), format!("-{n}"));
    }
    let pad = |n: u64, width: usize| {
        let mut line = Vec::new();
        padded(&mut line, n, width);
        String::from_utf8(line).unwrap()
    };
    assert_eq!(pad(7, 2), "07");
    assert_eq!(pad(7, 6), "000007");
    assert_eq!(pad(123_456, 6), "123456");
    assert_eq!(pad(2026, 4), "2026");
    // A number wider than asked is written whole.
    assert_eq!(pad(12_345, 2), "12345");
}

#[test]
fn timestamps_within_one_second_share_its_cached_text() {
    let mut line = Vec::new();
    let second = UNIX_EPOCH + Duration::from_secs(1_796_094_422);
    timestamp(
        &mut line,
        second + Duration::from_micros(1),
        LogFormat::Text,
    );
    timestamp(
        &mut line,
        second + Duration::from_micros(999_999),
        LogFormat::Json,
    );
    timestamp(
        &mut line,
        second + Duration::from_secs(86_400),
        LogFormat::Text,
    );
    assert_eq!(
        String::from_utf8(line).unwrap(),
        "2026-12-01T03:07:02.000001Z\
             {\"timestamp\":\"2026-12-01T03:07:02.999999Z\"\
             2026-12-02T03:07:02.000000Z"
    );
}

#[test]
fn timestamps_are_utc_with_microseconds() {
    let at = |secs: u64, micros: u32| {
        let mut line = Vec::new();
        let t = UNIX_EPOCH + Duration::new(secs, micros * 1000);
        timestamp(&mut line, t, LogFormat::Text);
        String::from_utf8(line).unwrap()
    };
    assert_eq!(at(0, 0), "1970-01-01T00:00:00.000000Z");
    assert_eq!(at(951_782_400, 7), "2000-02-29T00:00:00.000007Z");
    assert_eq!(at(1_700_000_000, 123_456), "2023-11-14T22:13:20.123456Z");
    assert_eq!(at(1_709_251_199, 999_999), "2024-02-29T23:59:59.999999Z");
    assert_eq!(at(1_796_094_422, 345_586), "2026-12-01T03:07:02.345586Z");
    assert_eq!(at(4_102_444_800, 0), "2100-01-01T00:00:00.000000Z");
}
