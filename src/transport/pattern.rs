//! The one pattern syntax of the gateway's identities and names: the
//! allow-lists (`--client-allow`, `--sink-allow`) and the access policy's
//! identities, collections and names.
//!
//! `*` matches any run of characters, `/` included, possibly none. `{name}`
//! captures one segment: one or more characters other than `/`. Everything
//! else is literal. A capture names what it took for the policy's `names`;
//! in a pattern that takes captures (an identity), each name appears once.
//!
//! Matching takes time linear in the input times the pattern, whatever the
//! pattern: a pattern with captures is matched by a table of which token
//! can match from which position (dynamic programming, no backtracking),
//! then one pass that reads the captures off the table; one without them
//! (every name glob) by finding its literals in order. Where several
//! matches exist, the captures are those of the leftmost-first one: each
//! star takes the shortest text it can, each capture the longest.

use std::fmt;

/// Wildcards and captures one pattern may hold: a pattern with captures is
/// matched with a table of one row per token, so this bounds that table to
/// `2 × MAX_WILDCARDS + 2` rows of the input's length.
pub const MAX_WILDCARDS: usize = 8;

/// The longest pattern accepted, in bytes.
pub const MAX_PATTERN_BYTES: usize = 1024;

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Token {
    Literal(String),
    /// `*`: any run of characters, `/` included, possibly empty.
    Star,
    /// `{name}`: one segment, one or more characters other than `/`.
    Capture(String),
}

/// Where `{name}` may appear in a pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Captures {
    /// Nowhere (collections).
    None,
    /// Each name once: the pattern takes them (identities). A name taken
    /// twice would have to match the same text twice, a back-reference,
    /// which no linear-time matcher decides: refused, so no grant rests on
    /// which of two segments a name stands for.
    Take,
    /// Any name, any number of times: the pattern uses what an identity
    /// took (the policy's `names`).
    Use,
}

/// What each capture of a pattern took from one input: `(name, text)`.
pub type Captured<'p, 'i> = Vec<(&'p str, &'i str)>;

/// A pattern as written, and its tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern {
    text: String,
    tokens: Vec<Token>,
}

impl Pattern {
    /// Parses `text`, with captures where `captures` allows them.
    pub fn parse(text: &str, captures: Captures) -> Result<Self, String> {
        if text.is_empty() {
            return Err("an empty pattern matches nothing".into());
        }
        if text.len() > MAX_PATTERN_BYTES {
            return Err(format!("a pattern is at most {MAX_PATTERN_BYTES} bytes"));
        }
        let mut tokens = Vec::new();
        let mut literal = String::new();
        let mut rest = text;
        while let Some(c) = rest.chars().next() {
            match c {
                '*' => {
                    push_literal(&mut tokens, &mut literal);
                    // `**` is `*`.
                    if tokens.last() != Some(&Token::Star) {
                        tokens.push(Token::Star);
                    }
                    rest = &rest[1..];
                }
                '{' => {
                    let Some(end) = rest.find('}') else {
                        return Err(format!("{text:?}: a `{{` without its `}}`"));
                    };
                    let name = &rest[1..end];
                    if captures == Captures::None {
                        return Err(format!(
                            "{text:?}: captures ({{{name}}}) are taken from identities and used in names; they are not \
                             allowed here"
                        ));
                    }
                    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                        return Err(format!(
                            "{text:?}: a capture is named with letters, digits and `_`, as {{namespace}}"
                        ));
                    }
                    if captures == Captures::Take && tokens.contains(&Token::Capture(name.to_owned())) {
                        return Err(format!(
                            "{text:?}: captures {{{name}}} twice; a name stands for one segment (a name used twice \
                             would have to match the same text twice, which is not checked): use two names, or `*` \
                             for the second"
                        ));
                    }
                    push_literal(&mut tokens, &mut literal);
                    tokens.push(Token::Capture(name.to_owned()));
                    rest = &rest[end + 1..];
                }
                '}' => return Err(format!("{text:?}: a `}}` without its `{{`")),
                c => {
                    literal.push(c);
                    rest = &rest[c.len_utf8()..];
                }
            }
        }
        push_literal(&mut tokens, &mut literal);
        let wild = tokens.iter().filter(|t| !matches!(t, Token::Literal(_))).count();
        if wild > MAX_WILDCARDS {
            return Err(format!(
                "{text:?}: at most {MAX_WILDCARDS} wildcards and captures in one pattern"
            ));
        }
        Ok(Pattern {
            text: text.to_owned(),
            tokens,
        })
    }

    /// The pattern as written.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Whether it matches everything (`*`).
    pub fn is_everything(&self) -> bool {
        self.tokens == [Token::Star]
    }

    /// The names it captures or uses.
    pub fn captures(&self) -> impl Iterator<Item = &str> {
        self.tokens.iter().filter_map(|t| match t {
            Token::Capture(name) => Some(name.as_str()),
            _ => None,
        })
    }

    /// Whether `input` matches, with what each capture took.
    pub fn matches<'i>(&self, input: &'i str) -> Option<Captured<'_, 'i>> {
        self.matches_counting(input, &mut 0)
    }

    /// [`Pattern::matches`], adding to `steps` the work done: one per cell
    /// of the table, and per byte a literal compares (the tests bound it).
    fn matches_counting<'i>(&self, input: &'i str, steps: &mut usize) -> Option<Captured<'_, 'i>> {
        if !self.tokens.iter().any(|t| matches!(t, Token::Capture(_))) {
            return literals_in_order(&self.tokens, input, steps).then(Vec::new);
        }
        match_table(&self.tokens, input, steps)
    }

    /// The pattern with each capture replaced by what it took, as literal
    /// text: a glob of literals and stars. `None` when a capture it uses
    /// took nothing (the policy checks at load that every name its `names`
    /// use is captured by every identity of the rule).
    pub fn substitute(&self, captured: &[(&str, &str)]) -> Option<Glob> {
        let mut tokens = Vec::new();
        let mut literal = String::new();
        for token in &self.tokens {
            match token {
                Token::Literal(text) => literal.push_str(text),
                Token::Capture(name) => {
                    let (_, value) = captured.iter().find(|(n, _)| n == name)?;
                    literal.push_str(value);
                }
                Token::Star => {
                    push_literal(&mut tokens, &mut literal);
                    tokens.push(Token::Star);
                }
            }
        }
        push_literal(&mut tokens, &mut literal);
        Some(Glob { tokens })
    }
}

fn push_literal(tokens: &mut Vec<Token>, literal: &mut String) {
    if !literal.is_empty() {
        tokens.push(Token::Literal(std::mem::take(literal)));
    }
}

/// Literals and stars (no captures): each literal found once, leftmost,
/// after the previous one; the first anchored at the start unless a star
/// leads, the last at the end unless a star trails. Leftmost is right: a
/// later occurrence leaves less input to what follows, never more. Work:
/// each literal's search starts where the previous one ended, so at most
/// the input's length per literal (`str::find` is linear: Two-Way).
fn literals_in_order(tokens: &[Token], input: &str, steps: &mut usize) -> bool {
    fn literal(token: &Token) -> Option<&str> {
        match token {
            Token::Literal(text) => Some(text.as_str()),
            _ => None,
        }
    }
    let mut rest = input;
    let (first, mut tokens) = match tokens.split_first() {
        None => return input.is_empty(),
        Some(split) => split,
    };
    let mut floating = false;
    match literal(first) {
        Some(text) => {
            *steps += text.len();
            match rest.strip_prefix(text) {
                Some(after) => rest = after,
                None => return false,
            }
        }
        None => floating = true,
    }
    while let Some((token, tail)) = tokens.split_first() {
        tokens = tail;
        let Some(text) = literal(token) else {
            floating = true;
            continue;
        };
        if tail.is_empty() {
            // The last literal is anchored at the end.
            *steps += text.len();
            return if floating { rest.ends_with(text) } else { rest == text };
        }
        let found = if floating {
            rest.find(text)
        } else {
            rest.starts_with(text).then_some(0)
        };
        match found {
            Some(at) => {
                *steps += at + text.len();
                rest = &rest[at + text.len()..];
            }
            None => {
                *steps += rest.len();
                return false;
            }
        }
        floating = false;
    }
    floating || rest.is_empty()
}

/// Tokens with captures: `ok[t][i]` says whether `tokens[t..]` match
/// `input[i..]`, filled from the last token back, each row from the row
/// after it in one pass over the input (a literal compares its bytes);
/// then one pass forward reads the captures off the table, each star the
/// shortest, each capture the longest its successors allow. Only char
/// boundaries are ever true, so every slice taken is one.
fn match_table<'p, 'i>(tokens: &'p [Token], input: &'i str, steps: &mut usize) -> Option<Captured<'p, 'i>> {
    let bytes = input.as_bytes();
    let n = bytes.len();
    let width = n + 1;
    // A cheap refusal first: the literal the pattern starts or ends with.
    if let Some(Token::Literal(first)) = tokens.first() {
        *steps += first.len();
        if !input.starts_with(first.as_str()) {
            return None;
        }
    }
    if let Some(Token::Literal(last)) = tokens.last() {
        *steps += last.len();
        if !input.ends_with(last.as_str()) {
            return None;
        }
    }
    let mut ok = vec![false; (tokens.len() + 1) * width];
    ok[tokens.len() * width + n] = true;
    for (t, token) in tokens.iter().enumerate().rev() {
        let (row, next) = ok[t * width..(t + 2) * width].split_at_mut(width);
        match token {
            Token::Literal(text) => {
                let text = text.as_bytes();
                for i in 0..width {
                    *steps += 1;
                    if i + text.len() <= n && next[i + text.len()] {
                        *steps += text.len();
                        // A literal is whole characters: matching bytes
                        // start and end on char boundaries.
                        row[i] = bytes[i..].starts_with(text);
                    }
                }
            }
            Token::Star => {
                let mut after = false;
                for i in (0..width).rev() {
                    *steps += 1;
                    if input.is_char_boundary(i) {
                        row[i] = next[i] || after;
                        after = row[i];
                    }
                }
            }
            Token::Capture(_) => {
                // `within`: some end in (i, the end of i's segment] at
                // which the rest matches.
                let mut within = false;
                for i in (0..n).rev() {
                    *steps += 1;
                    if bytes[i] == b'/' {
                        within = false;
                        continue;
                    }
                    within |= next[i + 1];
                    row[i] = within && input.is_char_boundary(i);
                }
            }
        }
    }
    if !ok[0] {
        return None;
    }
    let mut captured = Vec::new();
    let mut at = 0;
    for (t, token) in tokens.iter().enumerate() {
        let next = &ok[(t + 1) * width..(t + 2) * width];
        match token {
            Token::Literal(text) => at += text.len(),
            Token::Star => {
                let end = (at..width).find(|&j| next[j])?;
                *steps += end - at + 1;
                at = end;
            }
            Token::Capture(name) => {
                let segment = input[at..].find('/').map_or(n, |s| at + s);
                let end = (at + 1..=segment).rev().find(|&j| next[j])?;
                *steps += segment - at;
                captured.push((name.as_str(), &input[at..end]));
                at = end;
            }
        }
    }
    Some(captured)
}

/// A resource-name pattern with its captures filled in: literals and stars,
/// matched in linear time (the hot path: each name a restricted client may
/// be sent).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Glob {
    tokens: Vec<Token>,
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // A literal `*` (taken from a certificate) is written escaped so
            // that two globs print alike only when they match alike.
            Token::Literal(text) => f.write_str(&text.replace('\\', "\\\\").replace('*', "\\*")),
            Token::Star => f.write_str("*"),
            Token::Capture(name) => write!(f, "{{{name}}}"),
        }
    }
}

impl fmt::Display for Glob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.tokens.iter().try_for_each(|t| t.fmt(f))
    }
}

impl Glob {
    /// Whether it matches every name (`*`).
    pub fn is_everything(&self) -> bool {
        self.tokens == [Token::Star]
    }

    /// Whether `name` matches: literals in order, stars between them.
    pub fn matches(&self, name: &str) -> bool {
        literals_in_order(&self.tokens, name, &mut 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(text: &str) -> Pattern {
        Pattern::parse(text, Captures::Take).unwrap()
    }

    #[test]
    fn globs_match_in_order_and_anchored() {
        let glob = |text: &str| Pattern::parse(text, Captures::None).unwrap().substitute(&[]).unwrap();
        for (text, yes, no) in [
            ("abc", vec!["abc"], vec!["ab", "abcd", "xabc"]),
            ("a*", vec!["a", "ab", "a/b/c"], vec!["ba", ""]),
            ("*c", vec!["c", "abc"], vec!["ca"]),
            (
                "a*b*c",
                vec!["abc", "aXbYc", "abbc", "a/b/c"],
                vec!["ab", "acb", "abcx"],
            ),
            ("*", vec!["", "anything/at/all"], vec![]),
            ("*a*", vec!["a", "xay"], vec!["xyz"]),
            ("a**b", vec!["ab", "axb"], vec!["ba"]),
            ("ab*ab", vec!["abab", "abxab"], vec!["aba"]),
            ("*ab*ab*", vec!["abab", "xabyabz"], vec!["aba", "ab"]),
        ] {
            let g = glob(text);
            for y in yes {
                assert!(g.matches(y), "{text} matches {y:?}");
            }
            for n in no {
                assert!(!g.matches(n), "{text} does not match {n:?}");
            }
        }
    }

    /// Every match by brute force: each way to split `input` among the
    /// tokens, tried in the documented order (stars shortest, captures
    /// longest). Exponential: the reference the tests compare against.
    fn brute<'p, 'i>(tokens: &'p [Token], input: &'i str) -> Option<Captured<'p, 'i>> {
        let Some((first, rest)) = tokens.split_first() else {
            return input.is_empty().then(Vec::new);
        };
        let ends: Vec<usize> = (0..=input.len()).filter(|&i| input.is_char_boundary(i)).collect();
        match first {
            Token::Literal(text) => brute(rest, input.strip_prefix(text.as_str())?),
            Token::Star => ends.iter().find_map(|&i| brute(rest, &input[i..])),
            Token::Capture(name) => ends
                .iter()
                .rev()
                .filter(|&&i| i > 0 && !input[..i].contains('/'))
                .find_map(|&i| {
                    let mut captured = vec![(name.as_str(), &input[..i])];
                    captured.extend(brute(rest, &input[i..])?);
                    Some(captured)
                }),
        }
    }

    /// The table and the literal search agree with trying every split, on
    /// every pattern of a small alphabet against every input of another.
    #[test]
    fn matching_agrees_with_trying_every_split() {
        let patterns = [
            "a", "*", "a*", "*a", "*a*", "a*b", "*/*", "{x}", "{x}*", "*{x}", "{x}/{y}", "a{x}b", "{x}.b", "*{x}*",
            "{x}*{y}", "*/{x}/*", "a*{x}/b", "{x}a*a", "é{x}", "{x}é*",
        ];
        let alphabet = ["a", "b", "/", ".", "é"];
        let mut inputs = vec![String::new()];
        for _ in 0..4 {
            let longer: Vec<String> = inputs
                .iter()
                .flat_map(|i| alphabet.iter().map(move |c| format!("{i}{c}")))
                .collect();
            inputs.extend(longer);
        }
        inputs.sort();
        inputs.dedup();
        for text in patterns {
            let p = pattern(text);
            for input in &inputs {
                assert_eq!(p.matches(input), brute(&p.tokens, input), "{text:?} against {input:?}");
                let captureless =
                    Pattern::parse(&text.replace("{x}", "*").replace("{y}", "*"), Captures::None).unwrap();
                assert_eq!(
                    captureless.matches(input).is_some(),
                    match_table(&captureless.tokens, input, &mut 0).is_some(),
                    "{:?}: the literal search and the table agree on {input:?}",
                    captureless.text
                );
            }
        }
    }

    #[test]
    fn captures_take_one_segment_and_the_longest_text() {
        let p = pattern("spiffe://cluster.local/ns/{ns}/sa/*");
        assert_eq!(
            p.matches("spiffe://cluster.local/ns/shop/sa/frontend"),
            Some(vec![("ns", "shop")])
        );
        assert_eq!(
            p.matches("spiffe://cluster.local/ns/a/b/sa/frontend"),
            None,
            "one segment"
        );
        assert_eq!(p.matches("spiffe://cluster.local/ns//sa/frontend"), None, "not empty");
        let host = pattern("{host}.*");
        assert_eq!(host.matches("a.b.c"), Some(vec![("host", "a.b")]), "the longest");
        let two = pattern("{a}{b}");
        assert_eq!(two.matches("xyz"), Some(vec![("a", "xy"), ("b", "z")]));
    }

    /// A name taken twice in an identity is refused, naming it: it would
    /// grant what one segment holds to whoever another segment names.
    #[test]
    fn a_capture_taken_twice_is_refused() {
        let e = Pattern::parse("spiffe://cluster.local/ns/{ns}/sa/{ns}", Captures::Take).unwrap_err();
        assert!(e.contains("captures {ns} twice"), "{e}");
        assert!(
            Pattern::parse("{ns}/{ns}-*", Captures::Use).is_ok(),
            "names may use a name twice"
        );
        assert!(Pattern::parse("{a}/{b}", Captures::Take).is_ok());
    }

    /// The classic pathological globs, against a long input that almost
    /// matches (none starts or ends with a literal, so the table is filled
    /// whole): the work is counted, and stays within the input's length
    /// times the pattern's, where backtracking takes about n^k steps for k
    /// wildcards (2.9 s for `*a*a*a*a*a*a*a*b` against 42 characters).
    #[test]
    fn pathological_patterns_take_linear_work() {
        let n = 10_000;
        let san = "a".repeat(n);
        for (text, matching) in [
            ("{x}*a*a*a*a*a*b*", format!("{san}b")),
            ("*{x}*{y}*{z}*b{w}", format!("{san}ba")),
            ("{a}{b}{c}{d}{e}{f}{g}/{h}", format!("{san}/a")),
        ] {
            let p = pattern(text);
            let bound = (n + 3) * (2 * p.tokens.len() + 2 + text.len());
            let mut steps = 0;
            assert_eq!(p.matches_counting(&san, &mut steps), None, "{text}");
            assert!(steps <= bound, "{text}: {steps} steps, bound {bound}");
            assert!(steps >= n, "{text}: the table was filled ({steps} steps)");
            let mut steps = 0;
            assert!(p.matches_counting(&matching, &mut steps).is_some(), "{text}");
            assert!(steps <= bound, "{text}: {steps} steps to match, bound {bound}");
        }
        // Without captures: each literal searched for once.
        for text in ["*a*a*a*a*a*a*a*b", "*a*a*a*a*a*a*b*"] {
            let p = Pattern::parse(text, Captures::None).unwrap();
            let mut steps = 0;
            assert_eq!(p.matches_counting(&san, &mut steps), None, "{text}");
            assert!(steps <= 2 * n + text.len(), "{text}: {steps}");
            let glob = p.substitute(&[]).unwrap();
            assert!(!glob.matches(&san) && glob.matches(&format!("{san}b")), "{text}");
        }
    }

    #[test]
    fn bad_patterns_say_why() {
        let err = |text: &str, captures| Pattern::parse(text, captures).unwrap_err();
        assert!(err("{x}", Captures::None).contains("not allowed here"));
        assert!(err("a{b", Captures::Take).contains("without its"));
        assert!(err("a}b", Captures::Take).contains("without its"));
        assert!(err("{a-b}", Captures::Take).contains("letters, digits"));
        assert!(err("", Captures::Take).contains("empty"));
        assert!(err(&"*a".repeat(MAX_WILDCARDS + 1), Captures::Take).contains("at most 8 wildcards"));
        assert!(err(&"a".repeat(MAX_PATTERN_BYTES + 1), Captures::Take).contains("at most 1024 bytes"));
    }
}
