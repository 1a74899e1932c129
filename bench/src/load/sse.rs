//! A sans-IO reader of server-sent events: bytes in, `data` payloads out.

/// One event's data may not grow past this.
const MAX_EVENT_BYTES: usize = 4 << 20;

/// The stream broke the SSE framing or its size bound.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SseError {
    #[error("an SSE event is longer than {MAX_EVENT_BYTES} bytes")]
    TooLong,
    #[error("an SSE event is not UTF-8")]
    NotUtf8,
}

/// Splits a byte stream into the `data` of its events (comments and other fields are
/// dropped; several `data:` lines of one event are joined with `\n`).
#[derive(Debug, Default)]
pub(crate) struct SseReader {
    /// Bytes of the line being read.
    line: Vec<u8>,
    /// Data of the event being read.
    data: Option<String>,
}

impl SseReader {
    /// Feeds `bytes`, appending each completed event's data to `out`.
    pub(crate) fn push(&mut self, bytes: &[u8], out: &mut Vec<String>) -> Result<(), SseError> {
        for &b in bytes {
            if b != b'\n' {
                self.line.push(b);
                if self.line.len() > MAX_EVENT_BYTES {
                    return Err(SseError::TooLong);
                }
                continue;
            }
            if self.line.last() == Some(&b'\r') {
                self.line.pop();
            }
            let line = std::mem::take(&mut self.line);
            self.end_line(&line, out)?;
        }
        Ok(())
    }

    fn end_line(&mut self, line: &[u8], out: &mut Vec<String>) -> Result<(), SseError> {
        if line.is_empty() {
            out.extend(self.data.take());
            return Ok(());
        }
        let Some(value) = line.strip_prefix(b"data:") else {
            return Ok(()); // a comment (`:`), or a field we do not use
        };
        let value = value.strip_prefix(b" ").unwrap_or(value);
        let value = std::str::from_utf8(value).map_err(|_| SseError::NotUtf8)?;
        match &mut self.data {
            Some(data) if data.len() + 1 + value.len() > MAX_EVENT_BYTES => {
                return Err(SseError::TooLong)
            }
            Some(data) => {
                data.push('\n');
                data.push_str(value);
            }
            None => self.data = Some(value.to_owned()),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(chunks: &[&[u8]]) -> Vec<String> {
        let mut reader = SseReader::default();
        let mut out = Vec::new();
        for c in chunks {
            reader.push(c, &mut out).unwrap();
        }
        out
    }

    #[test]
    fn splits_events_across_chunks() {
        assert_eq!(
            events(&[
                b"data: {\"a\"",
                b":1}\n\n: keep-alive\n\nda",
                b"ta:[DONE]\r\n\r\n"
            ]),
            ["{\"a\":1}", "[DONE]"]
        );
        assert_eq!(
            events(&[b"event: x\ndata: a\ndata: b\n\ndata: c\n"]),
            ["a\nb"]
        );
    }

    #[test]
    fn bounds_events() {
        let mut reader = SseReader::default();
        let long = vec![b'x'; MAX_EVENT_BYTES + 1];
        assert_eq!(reader.push(&long, &mut Vec::new()), Err(SseError::TooLong));
    }
}
