//! Log output: stderr, text or JSON, kept off the request path.
//!
//! Events are formatted into a buffer per thread instead of one `write(2)` each (so that the
//! runtime's workers never write into the same memory); a background thread writes the
//! buffers out every [`FLUSH_EVERY`], and at once when a thread's buffer passes [`FLUSH_AT`]
//! bytes or an event is a warning or an error (so what explains a failure is never left
//! waiting in memory): the writer wakes the background thread, which writes; a serving thread
//! never writes to stderr itself, so a slow or blocked stderr (a full pipe, a stalled log
//! shipper) never stalls a request. [`flush`] writes what is left; `main` calls it before
//! the process exits. A SIGKILL loses at most the last [`FLUSH_EVERY`] of info lines.
//!
//! ANSI colours only when stderr is a terminal.
//!
//! The access line, one per request, does not go through `tracing`'s formatter: once [`init`] has
//! installed the subscriber, [`Event`] writes it straight into its thread's buffer in the same text
//! or JSON layout `tracing-subscriber` gives every other line (a unit test compares the two byte
//! for byte), at a fraction of the cost (no field visitor, no `Debug` of each value, no calendar
//! arithmetic through `fmt`; a line buffer kept per thread, the date and time of day worked out
//! once per second, numbers written two digits at a time). The subscriber's filter still decides
//! whether the line is written (`RUST_LOG`); under any other subscriber (a library user, a test)
//! the line is an ordinary `tracing` event.

use std::io::{IsTerminal, Write};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use tracing_subscriber::fmt::MakeWriter;

use crate::config::LogFormat;

/// How often buffered lines are written out.
pub const FLUSH_EVERY: Duration = Duration::from_millis(50);
/// A buffer this large is written out by the event that filled it.
pub const FLUSH_AT: usize = 64 * 1024;

/// The background thread that writes the buffers out, woken early by an urgent event.
static FLUSHER: OnceLock<Option<std::thread::Thread>> = OnceLock::new();
/// The layout [`init`] installed; unset when the library logs under another subscriber.
static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// The layout of the subscriber [`init`] installed, if it did: [`Event`] writes in it.
pub fn own_format() -> Option<LogFormat> {
    FORMAT.get().copied()
}

/// One thread's lines not yet written out. Each thread appends to its own, so the runtime's
/// workers never write into memory another core has just written (one shared buffer, and
/// its lock, moved between the cores at every line).
type Pending = crate::shard::Padded<Mutex<Vec<u8>>>;

/// Every thread's [`Pending`], for [`flush`]; a thread that has exited leaves its buffer here
/// until a flush has written it out.
static THREADS: Mutex<Vec<std::sync::Arc<Pending>>> = Mutex::new(Vec::new());

thread_local! {
    /// This thread's [`Pending`], registered in [`THREADS`] at its first line.
    static MINE: std::sync::Arc<Pending> = {
        let mine = std::sync::Arc::new(Pending::default());
        lock(&THREADS).push(std::sync::Arc::clone(&mine));
        mine
    };
}

/// A lock, also after a panic under it (a log buffer is always in a usable state).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The buffer written out last, emptied, kept to take a thread's buffer's place at the next
/// flush: writers append into room that is already there instead of growing a new buffer
/// (and freeing a large one) every time. Only touched under the lock of stderr.
static SPARE: Mutex<Vec<u8>> = Mutex::new(Vec::new());
/// A spare larger than this (after a burst) is dropped instead of kept.
const SPARE_KEPT: usize = 4 * FLUSH_AT;

/// Writes out whatever is buffered: each thread's lines in the order that thread wrote
/// them, a thread's whole buffer at a time (lines of different threads are ordered by their
/// timestamps, not by their place in the output). Flushes write one after another (under the
/// lock of stderr).
pub fn flush() {
    let mut err = std::io::stderr().lock();
    let mut spare = lock(&SPARE);
    let threads = {
        let mut threads = lock(&THREADS);
        let all = std::mem::take(&mut *threads);
        // A buffer only `all` holds belongs to a thread that has exited: written out below
        // for the last time, and forgotten.
        threads.extend(
            all.iter()
                .filter(|p| std::sync::Arc::strong_count(p) > 1)
                .cloned(),
        );
        all
    };
    for pending in threads {
        std::mem::swap(&mut *spare, &mut *lock(&pending.0));
        if !spare.is_empty() {
            let _ = err.write_all(&spare);
        }
        spare.clear();
    }
    let _ = err.flush();
    if spare.capacity() > SPARE_KEPT {
        *spare = Vec::new();
    }
}

/// The `MakeWriter` of the subscriber: one [`EventWriter`] per event.
#[derive(Clone, Copy)]
struct Buffered;

/// Appends one event to its thread's buffer; flushes on drop when it must.
struct EventWriter {
    urgent: bool,
}

impl Write for EventWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let buffered = MINE.try_with(|mine| {
            let mut pending = lock(&mine.0);
            pending.extend_from_slice(buf);
            if pending.len() >= FLUSH_AT {
                self.urgent = true;
            }
        });
        if buffered.is_err() {
            // A line from a thread's exit, after its buffer is gone: written out at once.
            std::io::stderr().lock().write_all(buf)?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        if self.urgent {
            match FLUSHER.get() {
                Some(Some(flusher)) => flusher.unpark(),
                // No background thread could be started: written here.
                _ => flush(),
            }
        }
    }
}

impl<'a> MakeWriter<'a> for Buffered {
    type Writer = EventWriter;

    fn make_writer(&'a self) -> EventWriter {
        EventWriter { urgent: false }
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> EventWriter {
        EventWriter {
            urgent: *meta.level() <= tracing::Level::WARN,
        }
    }
}

/// The caps on the PostgreSQL driver's own log (see [`init`]): the crate, and the modules
/// that log parameters (a more specific `RUST_LOG` directive would otherwise win).
const DRIVER_CAPS: [&str; 3] = [
    "tokio_postgres=info",
    "tokio_postgres::query=info",
    "tokio_postgres::prepare=info",
];

/// Installs the global subscriber: `RUST_LOG` (default `info`), text or JSON, buffered. Logs
/// never carry raw keys, scopes or bodies, at any level.
pub fn init(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    FLUSHER.get_or_init(|| {
        std::thread::Builder::new()
            .name("idemgate-log".into())
            .spawn(|| {
                loop {
                    // Woken early (`unpark`) by an event that must not wait.
                    std::thread::park_timeout(FLUSH_EVERY);
                    flush();
                }
            })
            .ok()
            .map(|handle| handle.thread().clone())
    });
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info"))
        // The PostgreSQL driver logs every statement with its parameters at debug: raw keys,
        // scopes and whole stored bodies. Capped at info whatever `RUST_LOG` says (a later
        // directive for the same target replaces an earlier one).
        ;
    let filter = DRIVER_CAPS.iter().fold(filter, |f, cap| {
        f.add_directive(cap.parse().expect("a valid directive"))
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(Buffered);
    let installed = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    if installed.is_ok() {
        let _ = FORMAT.set(format);
    }
}

/// A value of an [`Event`] field, written as `tracing` records it: strings quoted (text) or
/// as JSON strings, integers bare, an address (recorded with `%`, its `Display`) bare in text
/// and quoted in JSON.
pub enum Value<'a> {
    Str(&'a str),
    /// A string the gateway knows needs no escaping in either layout (printable ASCII without
    /// `"` or `\`: a method, a protocol, an outcome, a hex key id), written without scanning it.
    Plain(&'a str),
    U64(u64),
    I64(i64),
    Ip(std::net::IpAddr),
}

/// One log line written straight into the buffer (see the module docs): timestamp, level,
/// target, message, then the fields in order; in JSON, `tracing-subscriber`'s flattened
/// layout with `target` last.
///
/// The line is formatted in a buffer the thread keeps between lines (no allocation per
/// line) and then copied into the thread's buffer.
pub struct Event {
    line: Vec<u8>,
    format: LogFormat,
    target: &'static str,
    warn: bool,
}

thread_local! {
    /// The line buffer an [`Event`] borrows and gives back, with its capacity.
    static LINE: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A field's name with what goes before and after it, in both layouts: ` name=` in text,
/// `,"name":` in JSON. Made with `field_name!`, so each is one copy of a constant.
pub struct FieldName {
    pub text: &'static str,
    pub json: &'static str,
}

/// A [`FieldName`] made at compile time: `field_name!("status")`.
macro_rules! field_name {
    ($name:literal) => {
        $crate::logging::FieldName {
            text: concat!(" ", $name, "="),
            json: concat!(",\"", $name, "\":"),
        }
    };
}
pub(crate) use field_name;

impl Event {
    /// Starts a line at INFO, or WARN when `warn`, in `format`.
    pub fn new(format: LogFormat, warn: bool, target: &'static str, message: &str) -> Event {
        let mut line = LINE.take();
        line.clear();
        line.reserve(384);
        let level: &[u8] = if warn { b"WARN" } else { b"INFO" };
        timestamp(&mut line, std::time::SystemTime::now(), format);
        match format {
            LogFormat::Text => {
                line.extend_from_slice(if warn { b"  WARN " } else { b"  INFO " });
                line.extend_from_slice(target.as_bytes());
                line.extend_from_slice(b": ");
                line.extend_from_slice(message.as_bytes());
            }
            LogFormat::Json => {
                line.extend_from_slice(b",\"level\":\"");
                line.extend_from_slice(level);
                line.extend_from_slice(b"\",\"message\":");
                json_str(&mut line, message);
            }
        }
        Event {
            line,
            format,
            target,
            warn,
        }
    }

    /// Appends one field. Inlined, so that each name's copy is of a length known when
    /// compiling.
    #[inline(always)]
    pub fn field(&mut self, name: &FieldName, value: Value<'_>) -> &mut Event {
        let line = &mut self.line;
        match self.format {
            LogFormat::Text => {
                line.extend_from_slice(name.text.as_bytes());
                match value {
                    Value::Str(s) => text_str(line, s),
                    Value::Plain(s) => quoted(line, s),
                    Value::U64(n) => decimal(line, n, false),
                    Value::I64(n) => decimal(line, n.unsigned_abs(), n < 0),
                    Value::Ip(addr) => ip(line, addr),
                }
            }
            LogFormat::Json => {
                line.extend_from_slice(name.json.as_bytes());
                match value {
                    Value::Str(s) => json_str(line, s),
                    Value::Plain(s) => quoted(line, s),
                    Value::U64(n) => decimal(line, n, false),
                    Value::I64(n) => decimal(line, n.unsigned_abs(), n < 0),
                    Value::Ip(addr) => {
                        // An address has nothing a JSON string escapes.
                        line.push(b'"');
                        ip(line, addr);
                        line.push(b'"');
                    }
                }
            }
        }
        self
    }

    /// Ends the line and appends it to the buffer; a warning is written out at once.
    pub fn write(mut self) {
        if self.format == LogFormat::Json {
            self.line.extend_from_slice(b",\"target\":");
            json_str(&mut self.line, self.target);
            self.line.push(b'}');
        }
        self.line.push(b'\n');
        let mut writer = EventWriter { urgent: self.warn };
        let _ = writer.write(&self.line);
        drop(writer);
        LINE.set(std::mem::take(&mut self.line));
    }
}

thread_local! {
    /// The second [`timestamp`] last wrote on this thread, and its text up to the seconds.
    static SECOND: std::cell::Cell<(u64, [u8; 19])> = const { std::cell::Cell::new((u64::MAX, [0; 19])) };
}

/// `2026-12-01T03:07:02.345586Z` (UTC, microseconds), as `tracing-subscriber` writes it; in
/// JSON as the opening `{"timestamp":"...Z"`. The date and time of day are worked out once
/// per second per thread.
fn timestamp(line: &mut Vec<u8>, now: std::time::SystemTime, format: LogFormat) {
    let since = now
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = since.as_secs();
    let (cached, mut text) = SECOND.get();
    if cached != secs {
        text = civil(secs);
        SECOND.set((secs, text));
    }
    if format == LogFormat::Json {
        line.extend_from_slice(b"{\"timestamp\":\"");
    }
    line.extend_from_slice(&text);
    line.push(b'.');
    padded(line, u64::from(since.subsec_micros()), 6);
    line.push(b'Z');
    if format == LogFormat::Json {
        line.push(b'"');
    }
}

/// `2026-12-01T03:07:02` for seconds since the epoch (UTC).
fn civil(secs: u64) -> [u8; 19] {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's days_from_civil, inverted).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u64;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u64;
    let year = (yoe + era * 400 + i64::from(month <= 2)) as u64;
    let mut text = Vec::with_capacity(19);
    padded(&mut text, year, 4);
    text.push(b'-');
    padded(&mut text, month, 2);
    text.push(b'-');
    padded(&mut text, day, 2);
    text.push(b'T');
    padded(&mut text, rem / 3600, 2);
    text.push(b':');
    padded(&mut text, rem / 60 % 60, 2);
    text.push(b':');
    padded(&mut text, rem % 60, 2);
    text.try_into().unwrap_or([b'?'; 19])
}

/// `00` to `99`, for writing two digits at a time.
const PAIRS: &[u8; 200] = b"\
    0001020304050607080910111213141516171819\
    2021222324252627282930313233343536373839\
    4041424344454647484950515253545556575859\
    6061626364656667686970717273747576777879\
    8081828384858687888990919293949596979899";

/// `n` in decimal, zero-padded to `width` digits (at most 20).
fn padded(line: &mut Vec<u8>, mut n: u64, width: usize) {
    let mut digits = [b'0'; 20];
    let mut at = digits.len();
    while n >= 100 {
        let pair = (n % 100) as usize * 2;
        n /= 100;
        at -= 2;
        digits[at..at + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    }
    if n >= 10 {
        at -= 2;
        digits[at..at + 2].copy_from_slice(&PAIRS[n as usize * 2..n as usize * 2 + 2]);
    } else {
        at -= 1;
        digits[at] = b'0' + n as u8;
    }
    let start = digits.len() - width.clamp(digits.len() - at, digits.len());
    line.extend_from_slice(&digits[start..]);
}

/// `n` in decimal, with a minus sign when `negative`.
fn decimal(line: &mut Vec<u8>, n: u64, negative: bool) {
    if negative {
        line.push(b'-');
    }
    padded(line, n, 1);
}

/// An address as its `Display` writes it; an IPv4 one without `fmt`'s machinery, which costs
/// more than the rest of the access line's fields together.
fn ip(line: &mut Vec<u8>, addr: std::net::IpAddr) {
    match addr {
        std::net::IpAddr::V4(v4) => {
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    line.push(b'.');
                }
                decimal(line, u64::from(octet), false);
            }
        }
        std::net::IpAddr::V6(_) => {
            let _ = write!(line, "{addr}");
        }
    }
}

/// Bytes that both `Debug` of a `str` and JSON write as they are.
fn plain(s: &str) -> bool {
    s.bytes()
        .all(|b| (0x20..0x7f).contains(&b) && b != b'"' && b != b'\\')
}

/// A string that needs no escaping, between double quotes (the same in both layouts).
fn quoted(line: &mut Vec<u8>, s: &str) {
    debug_assert!(plain(s), "{s:?} needs escaping");
    line.push(b'"');
    line.extend_from_slice(s.as_bytes());
    line.push(b'"');
}

/// A string as `tracing`'s text layout records it: its `Debug` form.
fn text_str(line: &mut Vec<u8>, s: &str) {
    if plain(s) {
        quoted(line, s);
    } else {
        let _ = write!(line, "{s:?}");
    }
}

/// A string as a JSON string (`serde_json`'s escaping, as `tracing`'s JSON layout uses).
fn json_str(line: &mut Vec<u8>, s: &str) {
    if plain(s) {
        quoted(line, s);
    } else {
        let _ = serde_json::to_writer(&mut *line, s);
    }
}

#[cfg(test)]
mod tests;
