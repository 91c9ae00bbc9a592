//! Text a client or a source wrote (a node id, a NACK's message, a resource
//! name, a file's value) as an operator may see it: on a terminal (the tools'
//! text), in JSON (the tools' `-o json`, the admin port's JSON views, the
//! `--log-format json` log), in YAML (every `-o yaml`, the admin port's
//! YAML views) and in HTML (the admin port's pages). One rule decides which
//! characters are escaped ([`needs_escape`]); each format writes them its
//! own valid way, so nothing a client wrote can move the cursor, clear the
//! screen, retitle the window or reorder what is shown, and a JSON or YAML
//! parser reads back the text that was sent.
//!
//! In the transport room because every room that prints such text (the
//! tools, the admin port, the entry's log writer) may import it.

use std::borrow::Cow;
use std::fmt::Write as _;

/// A character a terminal (or a browser's bidirectional algorithm) acts on
/// rather than shows: every control character (C0, DEL, C1) and every
/// other character Rust's `char::escape_debug` escapes (the bidirectional
/// controls `U+200E`, `U+200F`, `U+202A`–`U+202E`, `U+2066`–`U+2069`,
/// `U+061C`, the other format characters such as `U+200B` and `U+FEFF`, the
/// line and paragraph separators, combining marks, unassigned code points).
pub fn needs_escape(c: char) -> bool {
    c.is_control() || (!c.is_ascii() && c.escape_debug().len() > 1)
}

/// What a view or a log shows in place of a value (or a key) it does not.
pub const REDACTED: &str = "[redacted]";

/// Whether the value of a metadata or annotation key may be printed: a
/// source's gRPC metadata (`config.source.version`), Galley's `--sinkMeta`
/// pairs, the gateway's own `--node-annotation` and `--sink-meta`. Only the
/// keys known to name no secret are (the component, the cluster, zone and
/// region, a version, a namespace, a node's name and role), in any case and
/// with `-`, `_` or `.` between words: any other value (`authorization`, a
/// `passphrase`, an `x-refresh`, whatever a list of credential words would
/// miss) is shown as `[redacted]` in the logs, the views and the effective
/// configuration ([`credential_shown`]), and sent as it is.
pub fn shows_its_value(key: &str) -> bool {
    const SHOWN: [&str; 20] = [
        "component",
        "configsourceversion",
        "istioversion",
        "version",
        "cluster",
        "clusterid",
        "clustername",
        "zone",
        "region",
        "namespace",
        "node",
        "nodeid",
        "nodename",
        "role",
        "app",
        "env",
        "environment",
        "meshid",
        "network",
        "name",
    ];
    let key: String = key
        .chars()
        .filter(|c| !matches!(c, '-' | '_' | '.'))
        .map(|c| c.to_ascii_lowercase())
        .collect();
    SHOWN.contains(&key.as_str())
}

/// Whether `value` is written as a credential is, whatever the key it is
/// under: an HTTP authorization scheme (`Bearer`, `Basic`, `Token`,
/// `Digest`, `Negotiate`, `MAC`, `AWS4-HMAC-SHA256`, in any case, then a
/// space, a tab, a colon or `%20`), a JSON Web Token anywhere in it (`eyJ…`
/// and a dot), a URL with user info (`postgres://u:pw@db`), a token of a
/// known shape (`ghp_…`, `github_pat_…`, `xox…-`, `AKIA…`, `sk_live_…`), or
/// any run of 24 or more letters, digits, `_`, `-`, `+`, `/` or `=` that
/// holds both letters and digits (a random token of a shape not listed; no
/// version, zone or cluster name is written so).
/// Whether `at` in `text` starts a word: the text's start, or after a
/// character that is neither a letter nor a digit (`task-runner` holds no
/// `sk-`).
fn at_word_start(text: &str, at: usize) -> bool {
    text[..at].chars().next_back().is_none_or(|c| !c.is_alphanumeric())
}

fn written_as_a_credential(value: &str) -> bool {
    let trimmed = value.trim_start();
    let lower = trimmed.to_lowercase();
    // Where a word starts: the value's start, or after a character that is
    // neither a letter nor a digit (`task-runner` holds no `sk-`).
    let starts = |word: &str| lower.match_indices(word).any(|(at, _)| at_word_start(&lower, at));
    let scheme = [
        "bearer",
        "basic",
        "token",
        "digest",
        "negotiate",
        "mac",
        "aws4-hmac-sha256",
    ]
    .iter()
    .any(|word| {
        lower
            .strip_prefix(word)
            .is_some_and(|rest| rest.starts_with(|c: char| c.is_whitespace() || c == ':') || rest.starts_with("%20"))
    });
    let jwt = trimmed.match_indices("eyJ").any(|(at, _)| trimmed[at..].contains('.'));
    let user_info = trimmed
        .split_once("://")
        .is_some_and(|(_, rest)| rest.split(['/', '?', '#']).next().is_some_and(|a| a.contains('@')));
    let shaped = [
        "ghp_",
        "gho_",
        "ghs_",
        "github_pat_",
        "xoxb-",
        "xoxp-",
        "akia",
        "glpat-",
        "glsa_",
        "sk-",
        "sk_",
        "rk_",
        "pk_live_",
        "whsec_",
        "npm_",
        "pypi-",
        "hf_",
        "aiza",
        "sg.",
        "shpat_",
        "dop_v1_",
        "ya29.",
        "-----begin",
    ]
    .iter()
    .any(|prefix| starts(prefix));
    // `password=…` inside a value (a connection string, a URL's query, a
    // header line, JSON): a credential word, then `=` or `:` (spaces, quotes
    // or a percent-encoded `=` between).
    let pair = [
        "password",
        "passwords",
        "passphrase",
        "pw",
        "sas",
        "credentials",
        "creds",
        "authorization",
        "cookie",
        "passwd",
        "pwd",
        "pass",
        "token",
        "secret",
        "sig",
        "signature",
        "apikey",
        "api_key",
        "api-key",
        "key",
        "access_key",
        "access_token",
        "client_secret",
        "private_key",
        "auth",
        "credential",
        "accountkey",
    ]
    .iter()
    .any(|word| {
        lower.match_indices(word).any(|(at, _)| {
            let boundary = at_word_start(&lower, at);
            let rest = lower[at + word.len()..].trim_start_matches([' ', '\t', '"', '\'']);
            boundary && (rest.starts_with(['=', ':']) || rest.starts_with("%3d"))
        })
    });
    // An AWS temporary key id (`ASIA` and capitals or digits; in capitals
    // only: `asia-east1` is a region).
    let temporary_key = trimmed.match_indices("ASIA").any(|(at, _)| {
        at_word_start(trimmed, at)
            && trimmed[at + 4..]
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_uppercase() || c.is_ascii_digit())
    });
    // `user:password@host` without a scheme.
    let bare_user_info = trimmed.split_whitespace().any(|token| {
        token
            .split_once('@')
            .is_some_and(|(user, host)| user.contains(':') && !host.is_empty() && !user.contains('/'))
    });
    let random = trimmed
        .split(|c: char| !(c.is_alphanumeric() || matches!(c, '_' | '-' | '+' | '/' | '=' | '%' | '.')))
        .any(|run| {
            run.chars().count() >= 24 && run.chars().any(char::is_alphabetic) && run.chars().any(char::is_numeric)
        });
    scheme || jwt || user_info || bare_user_info || shaped || pair || temporary_key || random
}

/// A metadata or annotation key as a view or a log may show it: as it is
/// when it is a plain name (letters, digits, `-`, `_`, `.`) not written as
/// a credential, else `[redacted]` (`authorization: Bearer …=` split at its
/// first `=` leaves the token in the key).
pub fn key_shown(key: &str) -> &str {
    let plain = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if plain && !written_as_a_credential(key) {
        key
    } else {
        REDACTED
    }
}

/// Whether `value` is written as the plain names those keys hold (a
/// version, a zone, a cluster, a node id): at most 253 bytes of ASCII
/// letters, digits, `.`, `-`, `_`, `~`, `:`, `+` and `/`, with no run of 24
/// or more letters or digits. Anything else (a space, `=`, `%`, `&`, `@`, a
/// backslash, a fullwidth or other non-ASCII letter, a long random run)
/// could be an encoding of a credential form that no list of forms would
/// name (`password%253D…`, `password&#61;…`, `ｐａｓｓｗｏｒｄ=…`), so it is
/// not shown.
fn written_as_a_plain_name(value: &str) -> bool {
    value.len() <= 253
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b'~' | b':' | b'+' | b'/'))
        && value
            .split(|c: char| !c.is_ascii_alphanumeric())
            .all(|run| run.len() < 24)
}

/// `value` as a view or a log may show it under `key`: `[redacted]` unless
/// the key is one whose value is shown ([`shows_its_value`]) and the value
/// is a plain name ([`written_as_a_plain_name`]) not written as a
/// credential (`Bearer:…`, `password:…`).
pub fn credential_shown<'a>(key: &str, value: &'a str) -> &'a str {
    if !shows_its_value(key) || !written_as_a_plain_name(value) || written_as_a_credential(value) {
        REDACTED
    } else {
        value
    }
}

/// `text` as it may be printed on an operator's terminal: every character
/// of [`needs_escape`] escaped as Rust writes it (`\n`, `\t`, `\x1b`,
/// `\u{202e}`), and then every backslash doubled (a text with none of those
/// is printed as it is), so what is printed is what was sent.
pub fn terminal_safe(text: &str) -> Cow<'_, str> {
    visible(text, false, false)
}

/// [`terminal_safe`] for a page that shows text in lines: line feeds and
/// tabs kept, everything else (a carriage return too) the same.
pub fn lines_safe(text: &str) -> Cow<'_, str> {
    visible(text, true, false)
}

/// [`terminal_safe`] that [`unescape`] reads back exactly, for a text that
/// is also a key (an identity: printed, then pasted into
/// `/debug/access?identity=`): a backslash is doubled whenever the text
/// holds one, not only when something else is escaped, so no two texts
/// print alike.
pub fn exact_safe(text: &str) -> Cow<'_, str> {
    visible(text, false, true)
}

/// What [`exact_safe`] printed, read back: `\\`, `\n`, `\r`, `\t`,
/// `\xHH` and `\u{H…}` become what they stand for; any other backslash
/// stays.
pub fn unescape(text: &str) -> Cow<'_, str> {
    if !text.contains('\\') {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('\\') {
        out.push_str(&rest[..at]);
        let escape = &rest[at..];
        let (c, len) = match escape.as_bytes().get(1) {
            Some(b'\\') => (Some('\\'), 2),
            Some(b'n') => (Some('\n'), 2),
            Some(b'r') => (Some('\r'), 2),
            Some(b't') => (Some('\t'), 2),
            Some(b'x') => (
                escape
                    .get(2..4)
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                    .filter(u8::is_ascii)
                    .map(char::from),
                4,
            ),
            Some(b'u') => match escape.get(2..).and_then(|s| s.strip_prefix('{')?.split_once('}')) {
                Some((hex, _)) => (
                    u32::from_str_radix(hex, 16).ok().and_then(char::from_u32),
                    hex.len() + 4,
                ),
                None => (None, 0),
            },
            _ => (None, 0),
        };
        match c {
            Some(c) => {
                out.push(c);
                rest = &escape[len..];
            }
            None => {
                out.push('\\');
                rest = &escape[1..];
            }
        }
    }
    out.push_str(rest);
    Cow::Owned(out)
}

fn visible(text: &str, keep_whitespace: bool, exact: bool) -> Cow<'_, str> {
    // A carriage return is escaped even in lines: on a terminal it would
    // write over what the line showed before it.
    let escaped = |c: char| needs_escape(c) && !(keep_whitespace && matches!(c, '\n' | '\t'));
    if !text.chars().any(|c| escaped(c) || (exact && c == '\\')) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            c if !escaped(c) => out.push(c),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_ascii() => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\u{{{:x}}}", c as u32);
            }
        }
    }
    Cow::Owned(out)
}

/// JSON for a terminal, a log or a page: what [`needs_escape`] escapes and
/// JSON does not (C1 controls, DEL, the bidirectional and other format
/// characters) written `\uXXXX` inside its strings, which is the same JSON
/// to any reader.
pub fn json_terminal_safe(json: String) -> String {
    match json_safe(&json) {
        Cow::Borrowed(_) => json,
        Cow::Owned(safe) => safe,
    }
}

/// [`json_terminal_safe`] of borrowed JSON (a log line, a response body).
pub fn json_safe(json: &str) -> Cow<'_, str> {
    // JSON escapes C0 in its strings itself: one outside them is its own
    // whitespace (a pretty-printed line end), kept.
    let escaped = |c: char| needs_escape(c) && c >= ' ';
    if !json.chars().any(escaped) {
        return Cow::Borrowed(json);
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
    Cow::Owned(out)
}

/// `value` as YAML in which every string holding a character of
/// [`needs_escape`] (a line end too) is a double-quoted scalar with that
/// character escaped (`"\u202E"`, `"\n"` …): valid YAML that reads back as
/// the text that was sent, and shows nothing raw. A line end is escaped
/// like the rest: in a literal block the text a source wrote would start
/// lines of its own on the terminal. Every other string is written as
/// `serde_norway` writes it.
pub fn yaml_terminal_safe<T: serde::Serialize + ?Sized>(value: &T) -> Result<String, serde_norway::Error> {
    let mut tree = serde_norway::to_value(value)?;
    // A mark no string of the value holds: each string to escape is written
    // as `{mark}{index}z` (a plain scalar), then replaced in the text.
    let mut mark = String::from("mcpgwescaped");
    while any_string(&tree, &|s| s.contains(mark.as_str())) {
        mark.push('x');
    }
    let mut taken = Vec::new();
    take_escaped(&mut tree, &mark, &mut taken);
    let mut yaml = serde_norway::to_string(&tree)?;
    if taken.is_empty() {
        return Ok(yaml);
    }
    // Highest index first: `…1z` is no part of `…10z`, and is replaced once.
    for (i, text) in taken.iter().enumerate().rev() {
        yaml = yaml.replacen(&format!("{mark}{i}z"), &yaml_quoted(text), 1);
    }
    Ok(yaml)
}

/// Whether any string (key or value) of `value` passes `test`.
fn any_string(value: &serde_norway::Value, test: &dyn Fn(&str) -> bool) -> bool {
    use serde_norway::Value;
    match value {
        Value::String(s) => test(s),
        Value::Sequence(items) => items.iter().any(|v| any_string(v, test)),
        Value::Mapping(map) => map.iter().any(|(k, v)| any_string(k, test) || any_string(v, test)),
        Value::Tagged(tagged) => any_string(&tagged.value, test),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

/// Replaces each string of `value` that holds a character to escape with
/// `{mark}{index}z`, its text pushed on `taken` at that index. A key longer
/// than YAML's implicit keys may be (1,024 characters) is escaped visibly
/// ([`terminal_safe`]) instead: its quoted form could not stand as one.
fn take_escaped(value: &mut serde_norway::Value, mark: &str, taken: &mut Vec<String>) {
    use serde_norway::Value;
    let take = |s: &mut String, taken: &mut Vec<String>| {
        if s.chars().any(needs_escape) {
            let placeholder = format!("{mark}{}z", taken.len());
            taken.push(std::mem::replace(s, placeholder));
        }
    };
    match value {
        Value::String(s) => take(s, taken),
        Value::Sequence(items) => items.iter_mut().for_each(|v| take_escaped(v, mark, taken)),
        Value::Mapping(map) => {
            let old = std::mem::take(map);
            for (mut key, mut item) in old {
                if let Value::String(k) = &mut key {
                    if yaml_quoted(k).len() < 1000 || !k.chars().any(needs_escape) {
                        take(k, taken);
                    } else if let Cow::Owned(safe) = terminal_safe(k) {
                        *k = safe;
                    }
                } else {
                    take_escaped(&mut key, mark, taken);
                }
                take_escaped(&mut item, mark, taken);
                map.insert(key, item);
            }
        }
        Value::Tagged(tagged) => take_escaped(&mut tagged.value, mark, taken),
        Value::Null | Value::Bool(_) | Value::Number(_) => {}
    }
}

/// `text` as a YAML double-quoted scalar, every character of
/// [`needs_escape`] escaped (`\n`, `\t`, `\r`, `\xXX`, `\uXXXX`,
/// `\UXXXXXXXX`), as well as `"` and `\`.
fn yaml_quoted(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if !needs_escape(c) => out.push(c),
            c if (c as u32) <= 0xff => {
                let _ = write!(out, "\\x{:02X}", c as u32);
            }
            c if (c as u32) <= 0xffff => {
                let _ = write!(out, "\\u{:04X}", c as u32);
            }
            c => {
                let _ = write!(out, "\\U{:08X}", c as u32);
            }
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::{json_terminal_safe, lines_safe, needs_escape, terminal_safe, yaml_terminal_safe};

    /// What a hostile client writes: ESC, a C1 CSI, bidi overrides and
    /// isolates, a zero-width space, a line separator.
    const HOSTILE: &str = "evil\x1b[31m\u{9b}2J\u{202e}gnp.exe\u{2066}x\u{2069}\u{200b}\u{2028}\u{200f}\u{61c}\u{feff}";

    /// The first character of `text` that would reach a terminal raw but
    /// its own line ends.
    fn raw(text: &str) -> Option<char> {
        text.split('\n').flat_map(str::chars).find(|&c| needs_escape(c))
    }

    #[test]
    fn only_values_of_keys_known_to_name_no_secret_are_shown() {
        for key in [
            "authorization",
            "Proxy-Authorization",
            "x-auth-token",
            "cookie",
            "API_KEY",
            "db-password",
            "x-jwt-assertion",
            "x-private-key",
            "x-session",
            "x-signature",
            "x-credz",
            "x-pwd",
            "x-api-sig",
            "x-otp",
            "passphrase",
            "x-pin",
            "x-refresh",
            "anything-else",
        ] {
            assert!(!super::shows_its_value(key), "{key}");
            assert_eq!(super::credential_shown(key, "abc"), "[redacted]");
        }
        // Written as a credential, under a key whose value is shown.
        for value in [
            "Bearer abc",
            "bearer abc",
            " BASIC dXNlcjpwdw==",
            "Bearer:abc",
            "Bearer\tabc",
            "Basic%20dXNlcjpwdw==",
            "Token abc",
            "Digest username=x",
            "Negotiate YII",
            "MAC id=x",
            "AWS4-HMAC-SHA256 Credential=x",
            "eyJhbGciOiJIUzI1NiJ9.e30.c2ln",
            "eyJhbGciOiJIUzI1NiJ9.e30",
            "id=eyJhbGciOiJIUzI1NiJ9.e30.c2ln",
            "postgres://u:pw@db/x",
            "ghp_abcdef",
            "sk_live_abc",
            "v=Zm9vYmFyYmF6cXV4MTIzNDU2Nzg5MA",
            "SK_LIVE_abc",
            "x sk_live_abc",
            "AIzaSyabc",
            "SG.abc.x",
            "shpat_abc",
            "dop_v1_abc",
            "ya29.abc",
            "glsa_abc",
            "Server=db;Password=abc;",
            "password=abc",
            "https://h/x?token=abc",
            "-----BEGIN PRIVATE KEY-----abc",
            "Bearer\u{a0}abc",
            "Zm9vYmFyYmF6%2BcXV4cXV1Qz25%3D%3D",
            "abcd1234.abcd1234.abcd1234",
            "password: abc",
            "password = abc",
            "{\"password\":\"abc\"}",
            "Password%3Dabc",
            "x-api-key: abc",
            "credential=abc",
            "AccountKey=abc",
            "credentials=abc",
            "Authorization: abc",
            "passphrase=abc",
            "ASIAQZ7",
            "u:abc@host",
            "ａｂｃｄｅｆｇｈｉｊ０１２３４５６７８９ａｂｃｄ",
            // Encodings no list of forms names, and single-class runs.
            "password%253Dabc",
            "p%61ssword=abc",
            "password%3Aabc",
            "password&#61;abc",
            "password\\u003dabc",
            "password\\x3dabc",
            "password＝abc",
            "ｐａｓｓｗｏｒｄ=abc",
            "ＡＳＩＡabc",
            "//u:abc@host",
            "u%3Aabc%40host",
            "@u:abc@h",
            "u:abc@",
            "abcdefghijklmnopqrstuvwxyzab",
            "123456789012345678901234567",
            "x 123456789012345678901234567",
            "cookie: session=abc",
            "a b",
        ] {
            assert_eq!(super::credential_shown("cluster", value), "[redacted]", "{value}");
        }
        assert_eq!(super::credential_shown("cluster", "Bear"), "Bear");
        for plain in [
            "1.3.0-20190611",
            "eu-west-1",
            "cluster-a.prod.example.com",
            "istio-system",
            "task-runner",
            "disk-1",
            "monkey",
            "asia-east1-a",
            "Asia",
            "sidecar~10.0.0.1~a.b~cluster.local",
            "v1.2.3+build.5",
            "",
        ] {
            assert_eq!(super::credential_shown("version", plain), plain);
        }
        for key in [
            "component",
            "config.source.version",
            "istio-version",
            "ISTIO_VERSION",
            "cluster",
            "zone",
        ] {
            assert!(super::shows_its_value(key), "{key}");
            assert_eq!(super::credential_shown(key, "v1"), "v1");
        }
    }

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
        assert_eq!(
            terminal_safe("\u{200e}\u{200f}\u{2066}\u{2069}\u{200b}\u{feff}\u{2028}"),
            "\\u{200e}\\u{200f}\\u{2066}\\u{2069}\\u{200b}\\u{feff}\\u{2028}"
        );
        // A backslash is doubled once anything is escaped, so a client's
        // literal `\x1b` is not mistaken for an escaped ESC.
        assert_eq!(terminal_safe("\\x1b\x1b"), "\\\\x1b\\x1b");
        // Alone, a backslash is printed as it is (Windows-like names stay readable).
        assert_eq!(terminal_safe("a\\b"), "a\\b");
        assert_eq!(terminal_safe("ünïcödé ✓ 日本"), "ünïcödé ✓ 日本");
        assert_eq!(lines_safe("a\nb\t\u{202e}"), "a\nb\t\\u{202e}");
        assert_eq!(raw(&terminal_safe(HOSTILE)), None);
    }

    #[test]
    fn exact_escapes_read_back_and_no_two_texts_print_alike() {
        use super::{exact_safe, unescape};
        for text in [
            "web.example",
            "a\\b",
            "a\\u{202e}",
            "a\u{202e}",
            "\\x1b\x1b\n\\",
            HOSTILE,
            "\u{10ffff}\u{e0001}",
            "\\u{zz}\\x",
        ] {
            let printed = exact_safe(text);
            assert_eq!(raw(&printed), None, "{printed}");
            assert_eq!(unescape(&printed), text, "{printed}");
        }
        assert_ne!(exact_safe("a\\u{202e}"), exact_safe("a\u{202e}"));
        assert_eq!(exact_safe("a\\b"), "a\\\\b");
        assert_eq!(unescape("plain"), "plain");
        // A backslash that escapes nothing is kept.
        assert_eq!(unescape("a\\qb\\u{110000}\\x"), "a\\qb\\u{110000}\\x");
    }

    #[test]
    fn json_reads_back_the_text_and_shows_none_of_it_raw() {
        let json = serde_json::to_string(&serde_json::json!({"node": "a\u{9b}31m\u{202e}b\x1b"})).unwrap();
        let safe = json_terminal_safe(json);
        assert_eq!(safe, r#"{"node":"a\u009b31m\u202eb\u001b"}"#);
        let pretty = serde_json::to_string_pretty(&serde_json::json!({"a": "\u{9b}"})).unwrap();
        assert_eq!(json_terminal_safe(pretty), "{\n  \"a\": \"\\u009b\"\n}");
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&safe).unwrap()["node"],
            "a\u{9b}31m\u{202e}b\x1b"
        );
        let hostile = json_terminal_safe(serde_json::to_string(&serde_json::json!({ HOSTILE: [HOSTILE] })).unwrap());
        assert_eq!(raw(&hostile), None, "{hostile}");
        let back: serde_json::Value = serde_json::from_str(&hostile).unwrap();
        assert_eq!(back[HOSTILE][0], HOSTILE);
    }

    #[test]
    fn yaml_reads_back_the_text_and_shows_none_of_it_raw() {
        #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
        struct Shown {
            node: String,
            plain: String,
            lines: String,
            names: Vec<String>,
            by_node: std::collections::BTreeMap<String, u32>,
            tag: Option<Kind>,
        }
        #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
        enum Kind {
            Nacked(String),
        }
        let long_key = format!("{}{HOSTILE}", "k".repeat(1100));
        let shown = Shown {
            node: HOSTILE.into(),
            plain: "sidecar~10.0.0.1~a.b~cluster.local mcpgwescaped0z".into(),
            lines: format!("first\nsecond {HOSTILE}\n\"quoted\" \\ \u{1F600} \u{E0001}"),
            names: vec![
                HOSTILE.into(),
                "ok".into(),
                format!("{HOSTILE}2"),
                "ctl/lf\nFORGED SYNCED".into(),
            ],
            by_node: [(HOSTILE.to_owned(), 1), ("plain".to_owned(), 2), (long_key.clone(), 3)].into(),
            tag: Some(Kind::Nacked(HOSTILE.into())),
        };
        let yaml = yaml_terminal_safe(&shown).unwrap();
        assert_eq!(raw(&yaml), None, "{yaml}");
        // A line end of a string is escaped too, with nothing else to
        // escape beside it: no text a source wrote starts a line.
        assert!(
            !yaml
                .lines()
                .any(|l| l.trim_start().starts_with("second") || l.trim_start().starts_with("FORGED")),
            "{yaml}"
        );
        let mut back: Shown = serde_norway::from_str(&yaml).unwrap();
        // The over-long key is escaped visibly; everything else reads back.
        let long = back.by_node.remove(&terminal_safe(&long_key).into_owned());
        assert_eq!(long, Some(3), "{yaml}");
        let mut expected = shown;
        expected.by_node.remove(&long_key);
        assert_eq!(back, expected);
        // Plain text is written as serde_norway writes it.
        let plain = serde_json::json!({"node": "a.b", "n": 1});
        assert_eq!(
            yaml_terminal_safe(&plain).unwrap(),
            serde_norway::to_string(&plain).unwrap()
        );
    }
}
