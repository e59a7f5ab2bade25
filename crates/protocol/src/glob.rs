//! SCAN patterns: a byte-wise glob with the semantics of the `glob` crate's `Pattern` under default
//! match options (spec §2), matched in `O(pattern × key)` time by simulating the pattern as an NFA —
//! never by backtracking, which is exponential on patterns like `*a*a*a*b`.
//!
//! * `?` one byte, `*` any bytes (crossing `/`), `[abc]`, `[a-z]`, `[!…]` negation; `[^…]` is a set
//!   containing `^`; `]` right after `[` or `[!` is a member; `[*]` matches a literal `*`.
//! * `**` must be a whole path component (`**`, `a/**`, `**/b`, `a/**/b`): it matches any bytes when
//!   last, otherwise nothing or any bytes ending in `/`. `***`, `a**` and `**b` are errors, as is an
//!   unclosed `[` — exactly the patterns `glob::Pattern::new` rejects.
//! * Anchored at both ends. Unlike `glob`, matching is per byte, not per `char`: keys are arbitrary
//!   bytes, and the two agree on ASCII.
//!
//! The common shapes — a literal key, `prefix*`, `*suffix`, `*` — are recognised when the pattern is
//! compiled and matched by a comparison of bytes, without the NFA (notification topics match every
//! write against their pattern, so this is on the write path).

use crate::error::ProtocolError;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Byte(u8),
    AnyByte,
    Set {
        negated: bool,
        items: Vec<SetItem>,
    },
    AnySequence,
    /// `**`: empty or anything ending in `/` (anything at all when it is the last token).
    AnyComponents,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SetItem {
    Byte(u8),
    Range(u8, u8),
}

/// A compiled SCAN pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Glob {
    tokens: Vec<Token>,
    /// `nullable_from[j]`: tokens `j..` can all match the empty string.
    nullable_from: Vec<bool>,
    shape: Shape,
}

/// What a pattern matches when it needs no NFA.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Shape {
    /// Exactly these bytes (no wildcard at all).
    Exact(Vec<u8>),
    /// These bytes, then anything (`prefix*`, `prefix/**`; `*` and `**` with an empty prefix).
    Prefix(Vec<u8>),
    /// Anything, then these bytes (`*suffix`).
    Suffix(Vec<u8>),
    General,
}

impl Shape {
    fn of(tokens: &[Token]) -> Shape {
        let literal = |tokens: &[Token]| -> Option<Vec<u8>> {
            tokens
                .iter()
                .map(|t| match t {
                    Token::Byte(b) => Some(*b),
                    _ => None,
                })
                .collect()
        };
        match tokens {
            // A `**` that ends the pattern matches any bytes, like `*`.
            [init @ .., Token::AnySequence | Token::AnyComponents] => {
                literal(init).map_or(Shape::General, Shape::Prefix)
            }
            [Token::AnySequence, rest @ ..] => literal(rest).map_or(Shape::General, Shape::Suffix),
            _ => literal(tokens).map_or(Shape::General, Shape::Exact),
        }
    }
}

impl Glob {
    /// Compiles `pattern`, rejecting what `glob::Pattern::new` rejects.
    pub fn new(pattern: &[u8]) -> Result<Glob, ProtocolError> {
        let mut tokens = Vec::new();
        let mut i = 0;
        while i < pattern.len() {
            match pattern[i] {
                b'?' => {
                    tokens.push(Token::AnyByte);
                    i += 1;
                }
                b'*' => {
                    let start = i;
                    while pattern.get(i) == Some(&b'*') {
                        i += 1;
                    }
                    match i - start {
                        1 => tokens.push(Token::AnySequence),
                        2 => {
                            let after_separator = start == 0 || pattern[start - 1] == b'/';
                            if !after_separator {
                                return Err(invalid(start.saturating_sub(1), RECURSIVE));
                            }
                            match pattern.get(i) {
                                // The separator after `**` belongs to it.
                                Some(b'/') => i += 1,
                                None => {}
                                Some(_) => return Err(invalid(i, RECURSIVE)),
                            }
                            // Consecutive `**/**/` collapse, as in `glob` (which keeps a leading pair).
                            if !(tokens.len() > 1 && tokens.last() == Some(&Token::AnyComponents)) {
                                tokens.push(Token::AnyComponents);
                            }
                        }
                        _ => {
                            return Err(invalid(
                                start + 2,
                                "wildcards are either regular `*` or recursive `**`",
                            ))
                        }
                    }
                }
                b'[' => {
                    let (token, consumed) = parse_bracket(&pattern[i..])
                        .ok_or_else(|| invalid(i, "invalid range pattern"))?;
                    tokens.push(token);
                    i += consumed;
                }
                byte => {
                    tokens.push(Token::Byte(byte));
                    i += 1;
                }
            }
        }
        let mut nullable_from = vec![true; tokens.len() + 1];
        for j in (0..tokens.len()).rev() {
            nullable_from[j] = nullable_from[j + 1]
                && matches!(tokens[j], Token::AnySequence | Token::AnyComponents);
        }
        let shape = Shape::of(&tokens);
        Ok(Glob {
            tokens,
            nullable_from,
            shape,
        })
    }

    /// Whether the whole of `input` matches the whole pattern.
    pub fn matches(&self, input: &[u8]) -> bool {
        match &self.shape {
            Shape::Exact(bytes) => input == bytes.as_slice(),
            Shape::Prefix(prefix) => input.starts_with(prefix),
            Shape::Suffix(suffix) => input.ends_with(suffix),
            Shape::General => self.matches_nfa(input),
        }
    }

    /// [`matches`](Self::matches) for any pattern, by simulating it as an NFA.
    fn matches_nfa(&self, input: &[u8]) -> bool {
        let n = self.tokens.len();
        // `at[j]`: the pattern has matched up to token j. `inside[j]`: token j is a `**` that has
        // consumed bytes not ending in `/`, so it may only continue or end the input. The four
        // state sets share one allocation.
        let mut states = vec![false; 4 * (n + 1)];
        let (mut at, rest) = states.split_at_mut(n + 1);
        let (mut inside, rest) = rest.split_at_mut(n + 1);
        let (mut next_at, mut next_inside) = rest.split_at_mut(n + 1);
        at[0] = true;
        self.close(at);
        for &byte in input {
            next_at.fill(false);
            next_inside.fill(false);
            let mut alive = false;
            for (j, token) in self.tokens.iter().enumerate() {
                if inside[j] {
                    if byte == b'/' {
                        next_at[j] = true;
                    } else {
                        next_inside[j] = true;
                    }
                    alive = true;
                }
                if !at[j] {
                    continue;
                }
                alive = true;
                match token {
                    Token::AnySequence => next_at[j] = true,
                    Token::AnyComponents if byte == b'/' => next_at[j] = true,
                    Token::AnyComponents => next_inside[j] = true,
                    Token::Byte(expected) => next_at[j + 1] |= *expected == byte,
                    Token::AnyByte => next_at[j + 1] = true,
                    Token::Set { negated, items } => {
                        next_at[j + 1] |= items.iter().any(|item| item.contains(byte)) != *negated;
                    }
                }
            }
            if !alive {
                return false;
            }
            self.close(next_at);
            std::mem::swap(&mut at, &mut next_at);
            std::mem::swap(&mut inside, &mut next_inside);
        }
        at[n] || (0..n).any(|j| inside[j] && self.nullable_from[j + 1])
    }

    /// Adds the states reachable by letting `*` and `**` match nothing.
    fn close(&self, at: &mut [bool]) {
        for (j, token) in self.tokens.iter().enumerate() {
            if at[j] && matches!(token, Token::AnySequence | Token::AnyComponents) {
                at[j + 1] = true;
            }
        }
    }
}

const RECURSIVE: &str = "recursive wildcards must form a single path component";

fn invalid(position: usize, reason: &'static str) -> ProtocolError {
    ProtocolError::InvalidGlob { position, reason }
}

impl SetItem {
    fn contains(self, byte: u8) -> bool {
        match self {
            SetItem::Byte(b) => b == byte,
            SetItem::Range(low, high) => low <= byte && byte <= high,
        }
    }
}

/// Parses the bracket expression at the start of `p` (which begins with `[`), returning the token and
/// the bytes consumed; `None` when unclosed. The first member may be `]` (after `[` or `[!`).
fn parse_bracket(p: &[u8]) -> Option<(Token, usize)> {
    let (negated, members_start) = if p.get(1) == Some(&b'!') {
        (true, 2)
    } else {
        (false, 1)
    };
    // At least one member, so the search for the closing `]` starts after the first one.
    let search_from = members_start + 1;
    if p.len() < search_from + 1 {
        return None;
    }
    let close = search_from + p[search_from..].iter().position(|&b| b == b']')?;
    let members = &p[members_start..close];
    let mut items = Vec::new();
    let mut k = 0;
    while k < members.len() {
        if k + 2 < members.len() && members[k + 1] == b'-' {
            items.push(SetItem::Range(members[k], members[k + 2]));
            k += 3;
        } else {
            items.push(SetItem::Byte(members[k]));
            k += 1;
        }
    }
    Some((Token::Set { negated, items }, close + 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn m(pattern: &str, input: &str) -> bool {
        Glob::new(pattern.as_bytes())
            .unwrap()
            .matches(input.as_bytes())
    }

    #[test]
    fn basics() {
        assert!(m("key*", "key"));
        assert!(m("key*", "key/a/b"));
        assert!(!m("key*", "akey"));
        assert!(m("c?t", "cat"));
        assert!(!m("c?t", "ct"));
        assert!(m("", ""));
        assert!(!m("", "a"));
        assert!(m("k[!e]tteh", "kitteh"));
        assert!(!m("k[!e]tteh", "ketteh"));
        assert!(m("[^a]", "^"));
        assert!(!m("[^a]", "b"));
        assert!(m("a[*]b", "a*b"));
        assert!(!m("a[*]b", "axb"));
        assert!(m("[]]", "]"));
        assert!(m("[!]]", "x"));
        assert!(!m("[!]]", "]"));
        assert!(m("[a-c-]", "-"));
        assert!(!m("[2-1]", "1"));
        assert!(m("a*b*c", "a___b___c"));
        assert!(!m("abc*abc*abc", "abcabcabcabcabcabcabca"));
    }

    #[test]
    fn recursive_wildcards() {
        assert!(m("some/**/needle.txt", "some/needle.txt"));
        assert!(m("some/**/needle.txt", "some/one/two/needle.txt"));
        assert!(!m("some/**/needle.txt", "some/other/notthis.txt"));
        assert!(m("**", ""));
        assert!(m("**", "/x/.asdf"));
        assert!(m("a/**", "a/xyz"));
        assert!(m("**/test", "test"));
        assert!(m("**/.*", "abc/.abc"));
        assert!(!m("**/.*", "ab.c"));
    }

    #[test]
    fn invalid_patterns() {
        for bad in [
            "a**b", "a/**b", "a/bc**", "***", "a/*****", "abc[def", "abc[!def", "abc[", "abc[!",
            "abc[]", "abc[!]", "[!",
        ] {
            assert!(Glob::new(bad.as_bytes()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn no_exponential_blowup() {
        let pattern = "*a".repeat(30) + "b";
        let input = "a".repeat(5_000);
        assert!(!m(&pattern, &input));
    }

    #[test]
    fn binary_keys() {
        let glob = Glob::new(b"\xff?*").unwrap();
        assert!(glob.matches(b"\xff\x00"));
        assert!(!glob.matches(b"\xfe\x00"));
    }

    fn ascii(alphabet: &'static [u8], max: usize) -> impl Strategy<Value = String> {
        prop::collection::vec(prop::sample::select(alphabet), 0..max)
            .prop_map(|b| String::from_utf8(b).unwrap())
    }

    #[test]
    fn shapes() {
        let shape = |p: &str| Glob::new(p.as_bytes()).unwrap().shape;
        assert_eq!(shape("order:1"), Shape::Exact(b"order:1".to_vec()));
        assert_eq!(shape(""), Shape::Exact(Vec::new()));
        assert_eq!(shape("order:*"), Shape::Prefix(b"order:".to_vec()));
        assert_eq!(shape("*"), Shape::Prefix(Vec::new()));
        assert_eq!(shape("**"), Shape::Prefix(Vec::new()));
        assert_eq!(shape("a/**"), Shape::Prefix(b"a/".to_vec()));
        assert_eq!(shape("*.json"), Shape::Suffix(b".json".to_vec()));
        assert_eq!(shape("a?*"), Shape::General);
        assert_eq!(shape("*a*"), Shape::General);
        assert_eq!(shape("**/a"), Shape::General);
        assert_eq!(shape("[a]"), Shape::General);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]
        /// The shapes' byte comparisons answer as the NFA does.
        #[test]
        fn shapes_agree_with_the_nfa(
            pattern in ascii(b"ab/*?[]", 8),
            input in ascii(b"ab/*[]", 10),
        ) {
            if let Ok(glob) = Glob::new(pattern.as_bytes()) {
                prop_assert_eq!(glob.matches(input.as_bytes()), glob.matches_nfa(input.as_bytes()),
                    "pattern {:?} ({:?}) input {:?}", pattern, glob.shape, input);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]
        #[test]
        fn agrees_with_glob_crate(
            pattern in ascii(b"ab/*?[]!^-", 10),
            input in ascii(b"ab/*[]!^-", 10),
        ) {
            let ours = Glob::new(pattern.as_bytes());
            let oracle = glob::Pattern::new(&pattern);
            prop_assert_eq!(ours.is_ok(), oracle.is_ok(), "compile {:?}", pattern);
            if let (Ok(ours), Ok(oracle)) = (ours, oracle) {
                prop_assert_eq!(ours.matches(input.as_bytes()), oracle.matches(&input),
                    "pattern {:?} input {:?}", pattern, input);
            }
        }
    }
}
