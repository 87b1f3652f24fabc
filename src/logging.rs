//! Log output: stderr, text or JSON, kept off the request path.
//!
//! Events are formatted into a shared buffer instead of one `write(2)` each; a background
//! thread writes the buffer out every [`FLUSH_EVERY`], and a writer flushes at once when the
//! buffer passes [`FLUSH_AT`] bytes or the event is a warning or an error (so what explains
//! a failure is never left waiting in memory). [`flush`] writes what is left; `main` calls it
//! before the process exits. A SIGKILL loses at most the last [`FLUSH_EVERY`] of info lines.
//!
//! ANSI colours only when stderr is a terminal.

use std::io::{IsTerminal, Write};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use tracing_subscriber::fmt::MakeWriter;

use crate::config::LogFormat;

/// How often buffered lines are written out.
pub const FLUSH_EVERY: Duration = Duration::from_millis(50);
/// A buffer this large is written out by the event that filled it.
pub const FLUSH_AT: usize = 64 * 1024;

static BUFFER: Mutex<Vec<u8>> = Mutex::new(Vec::new());
static FLUSHER: OnceLock<()> = OnceLock::new();

/// Writes out whatever is buffered.
pub fn flush() {
    let pending = std::mem::take(&mut *BUFFER.lock().unwrap_or_else(|e| e.into_inner()));
    if !pending.is_empty() {
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(&pending);
        let _ = err.flush();
    }
}

/// The `MakeWriter` of the subscriber: one [`EventWriter`] per event.
#[derive(Clone, Copy)]
struct Buffered;

/// Appends one event to the shared buffer; flushes on drop when it must.
struct EventWriter {
    urgent: bool,
}

impl Write for EventWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut pending = BUFFER.lock().unwrap_or_else(|e| e.into_inner());
        pending.extend_from_slice(buf);
        if pending.len() >= FLUSH_AT {
            self.urgent = true;
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
            flush();
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

/// Installs the global subscriber: `RUST_LOG` (default `info`), text or JSON, buffered.
pub fn init(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    FLUSHER.get_or_init(|| {
        let _ = std::thread::Builder::new()
            .name("idemgate-log".into())
            .spawn(|| {
                loop {
                    std::thread::sleep(FLUSH_EVERY);
                    flush();
                }
            });
    });
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(Buffered);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}
