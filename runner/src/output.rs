//! The child's stdout and stderr, line by line, to the runner's own:
//! prefixed `[ns/name token=N] ` so interleaved attempts stay readable,
//! or one JSON object per line for log pipelines.

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};

/// How lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Which of the child's streams a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    fn as_str(self) -> &'static str {
        match self {
            Self::Stdout => "stdout",
            Self::Stderr => "stderr",
        }
    }
}

/// Who a line belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    pub namespace: String,
    pub name: String,
    pub token: i64,
}

/// Longest line passed through in one piece; longer ones are split (a
/// child printing without newlines must not grow the runner's memory).
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// One line (without its `\n` or `\r\n`) as the runner writes it, newline
/// included. Invalid UTF-8 is replaced, not dropped.
pub fn format_line(format: LogFormat, origin: &Origin, stream: Stream, line: &[u8]) -> String {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let text = String::from_utf8_lossy(line);
    match format {
        LogFormat::Text => format!(
            "[{}/{} token={}] {text}\n",
            origin.namespace, origin.name, origin.token
        ),
        LogFormat::Json => {
            let v = serde_json::json!({
                "namespace": origin.namespace,
                "task": origin.name,
                "token": origin.token,
                "stream": stream.as_str(),
                "line": text,
            });
            format!("{v}\n")
        }
    }
}

/// Copies `from` to the runner's stdout (or stderr) until EOF.
pub async fn pump(from: impl AsyncRead + Unpin, format: LogFormat, origin: Origin, stream: Stream) {
    use std::io::Write;
    let mut reader = BufReader::new(from);
    let mut buf = Vec::with_capacity(256);
    loop {
        buf.clear();
        // At most MAX_LINE_BYTES per piece: read_until on a `take`.
        let n = match (&mut reader)
            .take(MAX_LINE_BYTES as u64)
            .read_until(b'\n', &mut buf)
            .await
        {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let out = format_line(format, &origin, stream, &buf[..n]);
        // Whole lines in one write: lines of concurrent attempts do not mix.
        let _ = match stream {
            Stream::Stdout => std::io::stdout().lock().write_all(out.as_bytes()),
            Stream::Stderr => std::io::stderr().lock().write_all(out.as_bytes()),
        };
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn origin() -> Origin {
        Origin {
            namespace: "ns".into(),
            name: "job".into(),
            token: 7,
        }
    }

    #[test]
    fn format_table() {
        let cases: [(LogFormat, Stream, &[u8], &str); 5] = [
            (
                LogFormat::Text,
                Stream::Stdout,
                b"hello\n",
                "[ns/job token=7] hello\n",
            ),
            (
                LogFormat::Text,
                Stream::Stderr,
                b"crlf\r\n",
                "[ns/job token=7] crlf\n",
            ),
            (
                LogFormat::Text,
                Stream::Stdout,
                b"no newline",
                "[ns/job token=7] no newline\n",
            ),
            (
                LogFormat::Text,
                Stream::Stdout,
                b"bad \xff byte\n",
                "[ns/job token=7] bad \u{fffd} byte\n",
            ),
            (
                LogFormat::Json,
                Stream::Stderr,
                b"say \"hi\"\n",
                "{\"line\":\"say \\\"hi\\\"\",\"namespace\":\"ns\",\"stream\":\"stderr\",\"task\":\"job\",\"token\":7}\n",
            ),
        ];
        for (format, stream, line, want) in cases {
            assert_eq!(format_line(format, &origin(), stream, line), want);
        }
    }
}
