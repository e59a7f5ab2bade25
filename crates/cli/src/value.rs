//! Keys and values on the command line: where a value comes from (argument, `@file`, `-` for stdin) and
//! how bytes are shown (escaped text, raw bytes, or JSON), so binary values survive both directions.

use std::fmt::Write as _;
use std::io::{Read, Write};

use serde_json::{Map, Value};

use super::error::CliError;

/// Largest value read from a file or stdin: the MQTT maximum packet size bounds what can be sent anyway.
pub const MAX_INPUT_BYTES: u64 = 256 * 1024 * 1024;

/// Output style shared by every command.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct OutputArgs {
    /// Print values as raw bytes, also on a terminal (the default when stdout is a file or a pipe).
    #[arg(long, conflicts_with_all = ["json", "escape"])]
    pub raw: bool,
    /// Print values as escaped text (`\xNN` for non-printable bytes), also into a file or a pipe (the
    /// default on a terminal).
    #[arg(long, conflicts_with = "json")]
    pub escape: bool,
    /// Print results and errors as JSON.
    #[arg(long)]
    pub json: bool,
}

impl OutputArgs {
    /// Whether values go out as raw bytes: asked for, or stdout is not a terminal (a file or a pipe,
    /// like redis-cli and etcdctl), so `mqstate get k > f` and `mqstate set k @f` round-trip.
    pub fn raw_values(&self) -> bool {
        self.raw || (!self.escape && !std::io::IsTerminal::is_terminal(&std::io::stdout()))
    }
}

/// Reads a value argument: `-` is stdin, `@path` is a file, anything else is the value itself.
pub fn read_value(arg: &str) -> Result<Vec<u8>, CliError> {
    if arg == "-" {
        read_limited(std::io::stdin().lock(), "the value from stdin")
    } else if let Some(path) = arg.strip_prefix('@') {
        let file = std::fs::File::open(path).map_err(|source| CliError::Input {
            what: format!("value file {path}"),
            source,
        })?;
        read_limited(file, &format!("value file {path}"))
    } else {
        Ok(arg.as_bytes().to_vec())
    }
}

fn read_limited(reader: impl Read, what: &str) -> Result<Vec<u8>, CliError> {
    let mut out = Vec::new();
    reader
        .take(MAX_INPUT_BYTES + 1)
        .read_to_end(&mut out)
        .map_err(|source| CliError::Input {
            what: what.to_owned(),
            source,
        })?;
    if out.len() as u64 > MAX_INPUT_BYTES {
        return Err(CliError::usage(
            what,
            format!("longer than {MAX_INPUT_BYTES} bytes, more than one MQTT packet can carry"),
        ));
    }
    Ok(out)
}

/// Printable ASCII stays as is; `\` and control or non-ASCII bytes are escaped, so the output is one
/// unambiguous line that can be pasted back into a shell with `printf`.
pub fn escape(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for &b in bytes {
        match b {
            b'\\' => out.push_str("\\\\"),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\t' => out.push_str("\\t"),
            0x20..=0x7e => out.push(char::from(b)),
            _ => {
                let _ = write!(out, "\\x{b:02x}");
            }
        }
    }
    out
}

/// Lower-case hex, for JSON output of bytes that are not UTF-8.
pub fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// Adds `name` (UTF-8 text) or `name_hex` (anything else) to a JSON object, so JSON output is lossless.
pub fn put_bytes(object: &mut Map<String, Value>, name: &str, bytes: &[u8]) {
    match std::str::from_utf8(bytes) {
        Ok(text) => object.insert(name.to_owned(), Value::String(text.to_owned())),
        Err(_) => object.insert(format!("{name}_hex"), Value::String(hex(bytes))),
    };
}

/// Writes one value raw, or escaped and followed by a newline.
pub fn write_value(out: &mut impl Write, raw: bool, bytes: &[u8]) -> std::io::Result<()> {
    if raw {
        out.write_all(bytes)
    } else {
        writeln!(out, "{}", escape(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_keeps_text_and_escapes_the_rest() {
        assert_eq!(escape(b"hello world"), "hello world");
        assert_eq!(escape(b"a\\b"), "a\\\\b");
        assert_eq!(escape(b"l1\nl2\t\r"), "l1\\nl2\\t\\r");
        assert_eq!(escape(&[0, 0xff, b'"']), "\\x00\\xff\"");
        assert_eq!(escape("é".as_bytes()), "\\xc3\\xa9");
    }

    #[test]
    fn json_bytes_are_text_or_hex() {
        let mut object = Map::new();
        put_bytes(&mut object, "value", b"plain");
        put_bytes(&mut object, "key", &[0xff, 0x00]);
        assert_eq!(object["value"], "plain");
        assert_eq!(object["key_hex"], "ff00");
        assert!(!object.contains_key("key"));
    }

    #[test]
    fn value_argument_forms() {
        assert_eq!(read_value("abc").unwrap(), b"abc");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.bin");
        std::fs::write(&path, [0u8, 1, 2, 0xff]).unwrap();
        let arg = format!("@{}", path.display());
        assert_eq!(read_value(&arg).unwrap(), vec![0u8, 1, 2, 0xff]);
        let missing = format!("@{}", dir.path().join("nope").display());
        assert!(matches!(read_value(&missing), Err(CliError::Input { .. })));
    }

    #[test]
    fn raw_output_is_byte_exact() {
        let mut out = Vec::new();
        write_value(&mut out, true, &[0, 10, 0xff]).unwrap();
        assert_eq!(out, vec![0, 10, 0xff]);
        let mut out = Vec::new();
        write_value(&mut out, false, &[0, 10, 0xff]).unwrap();
        assert_eq!(out, b"\\x00\\n\\xff\n");
    }
}
