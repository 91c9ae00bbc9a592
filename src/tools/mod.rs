//! Tools for operators and for measuring: the `check`, `client`, `status`
//! and `rollout` subcommands, the `source` subcommand's dial-out, and the fake
//! Galley that `mcp-load` (a binary of this crate, in `src/bin/mcp-load`)
//! and the integration tests share.

pub mod check;
pub mod client;
pub mod dial_out;
pub mod galley;
pub mod rollout;
pub mod status;

use std::borrow::Cow;
use std::fmt::Write as _;

/// Text a client or a source wrote (a node id, a NACK's message, a resource
/// name, a file's value) as it may be printed on an operator's terminal: every
/// control character (C0, DEL, C1) and every Unicode bidirectional control
/// escaped as Rust writes it (`\n`, `\t`, `\x1b`, `\u{202e}`), and then every
/// backslash doubled (a text with none of those is printed as it is), so what is printed
/// is what was sent, and nothing a client wrote can move the cursor, clear
/// the screen, retitle the window or reorder the line.
pub fn terminal_safe(text: &str) -> Cow<'_, str> {
    if !text.chars().any(needs_escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x80 && needs_escape(c) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if needs_escape(c) => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// JSON for a terminal: what [`terminal_safe`] escapes and JSON does not
/// (C1 controls, DEL, the bidirectional ones) written `\u00XX` inside its
/// strings, which is the same JSON to any reader.
pub fn json_terminal_safe(json: String) -> String {
    // JSON escapes C0 in its strings itself: one outside them is its own
    // whitespace (a pretty-printed line end), kept.
    let escaped = |c: char| needs_escape(c) && c >= ' ';
    if !json.chars().any(escaped) {
        return json;
    }
    let mut out = String::with_capacity(json.len() + 16);
    for c in json.chars() {
        if escaped(c) {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                let _ = write!(out, "\\u{unit:04x}");
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A character a terminal acts on rather than shows.
fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}' | '\u{061c}')
}

#[cfg(test)]
mod tests {
    use super::terminal_safe;

    #[test]
    fn control_characters_are_escaped_and_plain_text_is_borrowed() {
        assert!(matches!(
            terminal_safe("sidecar~10.0.0.1~a.b~cluster.local"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(terminal_safe("a\x1b[2Jb"), "a\\x1b[2Jb");
        assert_eq!(terminal_safe("line\nnext\r\t"), "line\\nnext\\r\\t");
        assert_eq!(terminal_safe("\x07\x7f\u{9b}"), "\\x07\\x7f\\u{9b}");
        assert_eq!(terminal_safe("evil\u{202e}txt.exe"), "evil\\u{202e}txt.exe");
        // A backslash is doubled once anything is escaped, so a client's
        // literal `\x1b` is not mistaken for an escaped ESC.
        assert_eq!(terminal_safe("\\x1b\x1b"), "\\\\x1b\\x1b");
        // Alone, a backslash is printed as it is (Windows-like names stay readable).
        assert_eq!(terminal_safe("a\\b"), "a\\b");
        assert_eq!(terminal_safe("ünïcödé ✓"), "ünïcödé ✓");
        let json = serde_json::to_string(&serde_json::json!({"node": "a\u{9b}31m\u{202e}b\x1b"})).unwrap();
        let safe = super::json_terminal_safe(json);
        assert_eq!(safe, r#"{"node":"a\u009b31m\u202eb\u001b"}"#);
        let pretty = serde_json::to_string_pretty(&serde_json::json!({"a": "\u{9b}"})).unwrap();
        assert_eq!(super::json_terminal_safe(pretty), "{\n  \"a\": \"\\u009b\"\n}");
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&safe).unwrap()["node"],
            "a\u{9b}31m\u{202e}b\x1b"
        );
    }
}
