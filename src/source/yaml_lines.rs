//! Lines in a YAML document: where the node at a path is (a field that a
//! reader refused, a duplicate name), and a parser's message rewritten to
//! count lines in the file rather than in the document.
//!
//! The line of a node is found by walking the document with serde down the
//! path and stopping at the node with an error: serde_norway marks an error
//! with where the reader stood, so no second YAML parser is needed.

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserializer;

use super::proto_json::PathStep;

/// The message of the error that stops the walk at the node (serde_norway
/// writes it after the path of the node, as `b.c: ...`).
const HERE: &str = "the node looked for";

/// The line (from 1, in `document`) of the node at `path`: of its key when
/// the path ends at a mapping's key, of the item when it ends at an index.
/// When the node is not in the document (a path a reader made up, or one
/// through an alias), the line of its nearest parent that is; `None` for
/// an empty path.
pub fn line_of(document: &str, path: &[PathStep]) -> Option<usize> {
    (1..=path.len())
        .rev()
        .find_map(|len| exact_line(document, &path[..len]))
}

/// The line of the node at `path` only when it is there (no parent's).
pub fn exact_line(document: &str, path: &[PathStep]) -> Option<usize> {
    let deserializer = serde_norway::Deserializer::from_str(document);
    match (Walk { path }).deserialize(deserializer) {
        Err(e) if e.to_string().contains(HERE) => e.location().map(|at| at.line()),
        _ => None,
    }
}

/// A parser's message about line `line`, column `column` of a document that
/// starts at line `start` of its file, with every line it names counted in
/// the file: the location that ends a reader's message is left out (the
/// caller names the line), a syntax error names it inside ("did not find
/// expected key at line 5 column 2, while parsing a block mapping").
pub fn in_file(message: &str, start: usize, line: usize, column: usize) -> String {
    let suffix = format!(" at line {line} column {column}");
    let Some(message) = message.strip_suffix(&suffix).filter(|m| !m.contains("line ")) else {
        return in_file_lines(message, start);
    };
    format!("{message} (column {column})")
}

/// The last "line N" a message names.
pub fn last_line_named(message: &str) -> Option<usize> {
    message
        .match_indices("line ")
        .filter_map(|(at, _)| {
            let digits: String = message[at + "line ".len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse().ok()
        })
        .last()
}

/// `message` with every "line N" counted from `start`.
fn in_file_lines(message: &str, start: usize) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find("line ") {
        let (before, after) = rest.split_at(at + "line ".len());
        out.push_str(before);
        let digits = after.find(|c: char| !c.is_ascii_digit()).unwrap_or(after.len());
        match after[..digits].parse::<usize>() {
            Ok(n) if digits > 0 => out.push_str(&(start + n.saturating_sub(1)).to_string()),
            _ => out.push_str(&after[..digits]),
        }
        rest = &after[digits..];
    }
    out.push_str(rest);
    out
}

/// Walks down `path`; at its end, fails with [`HERE`].
struct Walk<'a> {
    path: &'a [PathStep],
}

fn here<E: serde::de::Error>() -> E {
    E::custom(HERE)
}

fn absent<E: serde::de::Error>() -> E {
    E::custom("not in the document")
}

impl<'de> DeserializeSeed<'de> for Walk<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Walk<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let Some((PathStep::Key(wanted), rest)) = self.path.split_first() else {
            return Err(if self.path.is_empty() { here() } else { absent() });
        };
        while let Some(matched) = map.next_key_seed(Key {
            wanted,
            last: rest.is_empty(),
        })? {
            if matched {
                map.next_value_seed(Walk { path: rest })?;
                return Err(absent());
            }
            map.next_value::<IgnoredAny>()?;
        }
        Err(absent())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let Some((PathStep::Index(index), rest)) = self.path.split_first() else {
            return Err(if self.path.is_empty() { here() } else { absent() });
        };
        for _ in 0..*index {
            if seq.next_element::<IgnoredAny>()?.is_none() {
                return Err(absent());
            }
        }
        seq.next_element_seed(Walk { path: rest })?;
        Err(absent())
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<(), E> {
        self.scalar()
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<(), E> {
        self.scalar()
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<(), E> {
        self.scalar()
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<(), E> {
        self.scalar()
    }

    fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<(), E> {
        self.scalar()
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        self.scalar()
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<(), E> {
        self.scalar()
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl Walk<'_> {
    fn scalar<E: serde::de::Error>(&self) -> Result<(), E> {
        Err(if self.path.is_empty() { here() } else { absent() })
    }
}

/// A mapping key: whether it is the one wanted; at the path's end, the
/// walk stops on it.
struct Key<'a> {
    wanted: &'a str,
    last: bool,
}

impl<'de> DeserializeSeed<'de> for Key<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Key<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a mapping key")
    }

    fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<bool, E> {
        match key == self.wanted {
            true if self.last => Err(here()),
            matched => Ok(matched),
        }
    }

    fn visit_bool<E: serde::de::Error>(self, key: bool) -> Result<bool, E> {
        self.visit_str(&key.to_string())
    }

    fn visit_i64<E: serde::de::Error>(self, key: i64) -> Result<bool, E> {
        self.visit_str(&key.to_string())
    }

    fn visit_u64<E: serde::de::Error>(self, key: u64) -> Result<bool, E> {
        self.visit_str(&key.to_string())
    }

    fn visit_f64<E: serde::de::Error>(self, key: f64) -> Result<bool, E> {
        self.visit_str(&key.to_string())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<bool, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(false)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(false)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<bool, E> {
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(steps: &[&str]) -> Vec<PathStep> {
        steps
            .iter()
            .map(|s| match s.parse() {
                Ok(index) => PathStep::Index(index),
                Err(_) => PathStep::Key(s.to_string()),
            })
            .collect()
    }

    const DOC: &str = "\
a: 1
b:
  c:
  - x: 1
  - x: 2
    y:
      z: true
  d: {e: [1, 2], f: g}
\"80\": quoted
";

    #[test]
    fn nodes_are_found_at_their_line() {
        for (steps, line) in [
            (&["a"][..], Some(1)),
            (&["b"], Some(2)),
            (&["b", "c"], Some(3)),
            (&["b", "c", "0"], Some(4)),
            (&["b", "c", "1"], Some(5)),
            (&["b", "c", "1", "x"], Some(5)),
            (&["b", "c", "1", "y", "z"], Some(7)),
            (&["b", "d", "e", "1"], Some(8)),
            (&["b", "d", "f"], Some(8)),
            // Not there: the nearest parent that is.
            (&["b", "c", "1", "nope"], Some(5)),
            (&["b", "c", "7"], Some(3)),
            (&["nope"], None),
            (&[], None),
        ] {
            assert_eq!(line_of(DOC, &path(steps)), line, "{steps:?}");
        }
        // A key that reads as a number.
        assert_eq!(line_of(DOC, &[PathStep::Key("80".into())]), Some(9));
    }

    #[test]
    fn a_parser_message_counts_lines_in_the_file() {
        assert_eq!(
            in_file(
                "did not find expected key at line 5 column 2, while parsing a block mapping",
                11,
                5,
                2
            ),
            "did not find expected key at line 15 column 2, while parsing a block mapping"
        );
        assert_eq!(
            in_file("found a tab at line 3 column 1, context at line 1 column 1", 2, 3, 1),
            "found a tab at line 4 column 1, context at line 2 column 1"
        );
        assert_eq!(
            in_file("unknown field `x` at line 2 column 1", 5, 2, 1),
            "unknown field `x` (column 1)"
        );
    }
}
