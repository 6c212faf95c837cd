//! A read-side filter in front of hyper that turns a `Content-Length` hyper reserves into one
//! it takes.
//!
//! hyper keeps the three largest `u64` values (2^64 - 3 and up) for its own body states and
//! answers a request that declares one of them with `431 Request Header Fields Too Large`,
//! before our service sees it — a wrong status (the headers are small; the body is what is too
//! large). [`LengthGuard`] rewrites such a value, in place and with the same number of digits,
//! to 2^64 - 4: hyper then accepts the head, and the request gets the same immediate 413 as any
//! other body over `--max-request-bytes`. Nothing else is changed.
//!
//! The guard follows the HTTP/1 framing of the request stream, so it looks only at header lines
//! (never at a body that happens to contain such text): a head runs to its empty line, a body
//! for its `Content-Length`; after a `Transfer-Encoding` body it stops looking (a chunked body
//! with a huge length is something hyper already answers). A line is held back until its line
//! feed arrives, so a value split across reads is still seen whole.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// hyper's largest accepted `Content-Length` (its `DecodedLength::MAX_LEN`, 2^64 - 4).
const LARGEST_ACCEPTED_LENGTH: u64 = u64::MAX - 3;

/// A header line longer than this is passed on unread: hyper refuses the head anyway
/// (`--max-header-bytes`), and the guard never buffers without bound.
const MAX_LINE_BYTES: usize = 64 * 1024;

/// Where the guard is in the request stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// Reading a request head; `started` once its request line has come (empty lines before
    /// one are skipped, as RFC 9112 allows). The fields are what the head declared so far.
    Head {
        started: bool,
        content_length: u64,
        transfer_encoding: bool,
    },
    /// Inside a body with this many bytes still to come.
    Body { remaining: u64 },
    /// Not looking any more: bytes pass as they are.
    Opaque,
}

impl Framing {
    const NEW_HEAD: Framing = Framing::Head {
        started: false,
        content_length: 0,
        transfer_encoding: false,
    };
}

/// Wraps a connection's byte stream; see the module comment.
pub struct LengthGuard<T> {
    inner: T,
    framing: Framing,
    /// The current header line, until its `\n`.
    line: Vec<u8>,
    /// Bytes ready for hyper, from `ready_from` on.
    ready: Vec<u8>,
    ready_from: usize,
}

impl<T> LengthGuard<T> {
    pub fn new(inner: T) -> LengthGuard<T> {
        LengthGuard {
            inner,
            framing: Framing::NEW_HEAD,
            line: Vec::new(),
            ready: Vec::new(),
            ready_from: 0,
        }
    }

    /// Takes bytes read from the client, moving what may go on to `ready`.
    fn scan(&mut self, mut input: &[u8]) {
        while !input.is_empty() {
            match self.framing {
                Framing::Opaque => {
                    self.ready.extend_from_slice(input);
                    return;
                }
                Framing::Body { remaining } => {
                    let n = (remaining.min(input.len() as u64)) as usize;
                    self.ready.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    self.framing = if remaining == n as u64 {
                        Framing::NEW_HEAD
                    } else {
                        Framing::Body {
                            remaining: remaining - n as u64,
                        }
                    };
                }
                Framing::Head { .. } => match input.iter().position(|&b| b == b'\n') {
                    Some(end) => {
                        self.line.extend_from_slice(&input[..=end]);
                        input = &input[end + 1..];
                        self.end_line();
                    }
                    None => {
                        self.line.extend_from_slice(input);
                        if self.line.len() > MAX_LINE_BYTES {
                            self.pass_line();
                            self.framing = Framing::Opaque;
                        }
                        return;
                    }
                },
            }
        }
    }

    /// A complete head line (with its `\n`) is in `line`: read it, mend it, pass it on.
    fn end_line(&mut self) {
        let Framing::Head {
            started,
            content_length,
            transfer_encoding,
        } = self.framing
        else {
            unreachable!("lines are read only in a head");
        };
        let blank = matches!(self.line.as_slice(), b"\n" | b"\r\n");
        self.framing = if blank && !started {
            Framing::NEW_HEAD
        } else if blank {
            match (transfer_encoding, content_length) {
                (true, _) => Framing::Opaque,
                (false, 0) => Framing::NEW_HEAD,
                (false, remaining) => Framing::Body { remaining },
            }
        } else if !started {
            Framing::Head {
                started: true,
                content_length,
                transfer_encoding,
            }
        } else {
            let (content_length, transfer_encoding) = match header_name(&self.line) {
                Some(name) if name.eq_ignore_ascii_case(b"content-length") => {
                    (mend_content_length(&mut self.line), transfer_encoding)
                }
                Some(name) if name.eq_ignore_ascii_case(b"transfer-encoding") => {
                    (content_length, true)
                }
                _ => (content_length, transfer_encoding),
            };
            Framing::Head {
                started,
                content_length,
                transfer_encoding,
            }
        };
        self.pass_line();
    }

    fn pass_line(&mut self) {
        self.ready.append(&mut self.line);
    }
}

/// The name of a `name: value` header line.
fn header_name(line: &[u8]) -> Option<&[u8]> {
    line.iter().position(|&b| b == b':').map(|i| &line[..i])
}

/// Rewrites every number in a `Content-Length` line that hyper would reserve to
/// [`LARGEST_ACCEPTED_LENGTH`], keeping its width; returns the length the line declares (the
/// largest of its numbers, 0 when it has none; a bad value is hyper's to refuse).
fn mend_content_length(line: &mut [u8]) -> u64 {
    let start = line.iter().position(|&b| b == b':').map_or(0, |i| i + 1);
    let mut declared = 0u64;
    let mut i = start;
    while i < line.len() {
        if !line[i].is_ascii_digit() {
            i += 1;
            continue;
        }
        let run_start = i;
        while i < line.len() && line[i].is_ascii_digit() {
            i += 1;
        }
        let digits = &mut line[run_start..i];
        let value = std::str::from_utf8(digits)
            .ok()
            .and_then(|s| s.parse::<u64>().ok());
        let value = match value {
            Some(v) if v > LARGEST_ACCEPTED_LENGTH => {
                let width = digits.len();
                let mended = format!("{LARGEST_ACCEPTED_LENGTH:0width$}");
                digits.copy_from_slice(mended.as_bytes());
                LARGEST_ACCEPTED_LENGTH
            }
            Some(v) => v,
            // Over u64: hyper answers 400 itself; look no further at this connection's bytes.
            None => u64::MAX,
        };
        declared = declared.max(value);
    }
    declared
}

impl<T: AsyncRead + Unpin> AsyncRead for LengthGuard<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.ready_from < this.ready.len() {
                let ready = &this.ready[this.ready_from..];
                let n = ready.len().min(buf.remaining());
                buf.put_slice(&ready[..n]);
                this.ready_from += n;
                if this.ready_from == this.ready.len() {
                    this.ready.clear();
                    this.ready_from = 0;
                }
                return Poll::Ready(Ok(()));
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) if read.filled().is_empty() => {
                    // End of the stream: a partial line goes on as it is, then the EOF.
                    if this.line.is_empty() {
                        return Poll::Ready(Ok(()));
                    }
                    this.pass_line();
                }
                Poll::Ready(Ok(())) => {
                    let n = read.filled().len();
                    this.scan(&chunk[..n]);
                }
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for LengthGuard<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the guard passes on for `input` fed in pieces of `piece` bytes.
    fn filtered(input: &[u8], piece: usize) -> Vec<u8> {
        let mut guard = LengthGuard::new(());
        for chunk in input.chunks(piece) {
            guard.scan(chunk);
        }
        guard.pass_line();
        guard.ready
    }

    fn each_split(input: &[u8], expected: &[u8]) {
        for piece in 1..=input.len() {
            assert_eq!(
                String::from_utf8_lossy(&filtered(input, piece)),
                String::from_utf8_lossy(expected),
                "in pieces of {piece} bytes"
            );
        }
    }

    #[test]
    fn a_reserved_length_becomes_the_largest_accepted_one() {
        for (sent, mended) in [
            ("18446744073709551615", "18446744073709551612"),
            ("18446744073709551613", "18446744073709551612"),
            ("018446744073709551614", "018446744073709551612"),
        ] {
            let request = format!(
                "POST /v1/completions HTTP/1.1\r\nHost: h\r\ncontent-LENGTH: {sent}\r\n\r\n{{}}"
            );
            let expected = request.replace(sent, mended);
            each_split(request.as_bytes(), expected.as_bytes());
        }
    }

    #[test]
    fn accepted_and_invalid_lengths_pass_unchanged() {
        for value in ["18446744073709551612", "12", "18446744073709551616", "x"] {
            let request = format!("POST / HTTP/1.1\r\nContent-Length: {value}\r\n\r\n");
            each_split(request.as_bytes(), request.as_bytes());
        }
    }

    #[test]
    fn bodies_are_never_read_as_headers() {
        // The first body is 44 bytes that look like a header line; the pipelined second
        // request's length is mended.
        let body = "\r\nContent-Length: 18446744073709551615\r\n\r\n";
        let first = format!(
            "POST /a HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let second = "\r\nPOST /b HTTP/1.1\r\nContent-Length: 18446744073709551615\r\n\r\n";
        let input = format!("{first}{second}");
        let expected = format!(
            "{first}{}",
            second.replace("18446744073709551615", "18446744073709551612")
        );
        each_split(input.as_bytes(), expected.as_bytes());
    }

    #[test]
    fn after_a_chunked_body_nothing_is_touched() {
        let input = "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n\
                     POST / HTTP/1.1\r\nContent-Length: 18446744073709551615\r\n\r\n";
        each_split(input.as_bytes(), input.as_bytes());
    }

    #[test]
    fn an_endless_line_is_passed_on_unbuffered() {
        let mut input = b"GET / HTTP/1.1\r\nX: ".to_vec();
        input.resize(MAX_LINE_BYTES * 2, b'a');
        let out = filtered(&input, 4096);
        assert_eq!(out, input);
    }
}
