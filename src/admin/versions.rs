//! Versions as people read and type them. A collection's content version is
//! 32 hex characters: the HTML views show its first 12 (the whole one on
//! hover; JSON always carries it whole), and every endpoint that takes a
//! version (`/pin`, `/debug/diff`) accepts the whole one or any prefix of at
//! least 8 characters that begins exactly one version of the collection's
//! history.

use axum::http::StatusCode;

use crate::cache::Cache;

/// Characters of a version the views show.
pub const SHOWN: usize = 12;

/// The shortest prefix that stands for a version.
pub const MIN_PREFIX: usize = 8;

/// The first [`SHOWN`] characters of `version`.
pub fn short(version: &str) -> &str {
    match version.char_indices().nth(SHOWN) {
        Some((end, _)) => &version[..end],
        None => version,
    }
}

/// Why a version given by an operator stands for no version.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum VersionError {
    #[error(
        "version {given:?} of {collection:?} is not in the history (it keeps the last --history={kept} versions; \
         see /debug/history/{collection})"
    )]
    NotFound {
        collection: String,
        given: String,
        kept: usize,
    },
    #[error(
        "{given:?} is too short to name a version of {collection:?}: give the version or a prefix of at least \
         {MIN_PREFIX} characters (see /debug/history/{collection})"
    )]
    TooShort { collection: String, given: String },
    #[error(
        "{given:?} begins {} versions of {collection:?}: {}; give more characters",
        matches.len(),
        matches.join(", ")
    )]
    Ambiguous {
        collection: String,
        given: String,
        matches: Vec<String>,
    },
}

impl VersionError {
    /// 404 for a version that is not there, 400 for a prefix that does not
    /// name one.
    pub fn status(&self) -> StatusCode {
        match self {
            VersionError::NotFound { .. } => StatusCode::NOT_FOUND,
            VersionError::TooShort { .. } | VersionError::Ambiguous { .. } => StatusCode::BAD_REQUEST,
        }
    }
}

/// The version of `known` (the collection's history) that `given` names: one
/// equal to it, else the one it is a prefix of (at least [`MIN_PREFIX`]
/// characters).
pub fn resolve<'a>(
    collection: &str,
    kept: usize,
    known: impl IntoIterator<Item = &'a str>,
    given: &str,
) -> Result<String, VersionError> {
    let known: Vec<&str> = known.into_iter().collect();
    if known.contains(&given) {
        return Ok(given.to_owned());
    }
    // Under the shortest prefix is a 400 whether or not it begins a version:
    // what it answers must not depend on the history's content.
    if given.chars().count() < MIN_PREFIX {
        return Err(VersionError::TooShort {
            collection: collection.to_owned(),
            given: given.to_owned(),
        });
    }
    let mut matches: Vec<String> = known
        .iter()
        .filter(|v| !given.is_empty() && v.starts_with(given))
        .map(|v| (*v).to_owned())
        .collect();
    matches.dedup();
    match matches.len() {
        0 => Err(VersionError::NotFound {
            collection: collection.to_owned(),
            given: given.to_owned(),
            kept,
        }),
        1 => Ok(matches.remove(0)),
        _ => Err(VersionError::Ambiguous {
            collection: collection.to_owned(),
            given: given.to_owned(),
            matches,
        }),
    }
}

/// [`resolve`] against what the cache's history holds of `collection`.
pub fn resolve_in(cache: &Cache, collection: &str, given: &str) -> Result<String, VersionError> {
    let history = cache.history(collection).unwrap_or_default();
    resolve(
        collection,
        cache.history_len(),
        history.iter().map(|entry| &*entry.version),
        given,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "0123456789abcdef0123456789abcdef";
    const B: &str = "0123456789ab0000ffffffffffffffff";
    const C: &str = "fedcba9876543210fedcba9876543210";

    fn named(given: &str) -> Result<String, VersionError> {
        resolve("c", 10, [A, B, C], given)
    }

    #[test]
    fn a_version_is_named_whole_or_by_a_unique_prefix_of_eight() {
        assert_eq!(named(A).unwrap(), A);
        assert_eq!(named(short(C)).unwrap(), C);
        assert_eq!(named("fedcba98").unwrap(), C);
        assert_eq!(named("0123456789abc").unwrap(), A);
        assert_eq!(short(A), "0123456789ab");
        assert_eq!(short("v1"), "v1");
    }

    #[test]
    fn what_names_no_version_says_why() {
        let ambiguous = named("0123456789ab").unwrap_err();
        assert_eq!(ambiguous.status(), StatusCode::BAD_REQUEST);
        let said = ambiguous.to_string();
        assert!(
            said.contains(A) && said.contains(B) && said.contains("begins 2 versions"),
            "{said}"
        );
        let short = named("fedcba9").unwrap_err();
        assert!(matches!(short, VersionError::TooShort { .. }), "{short}");
        assert!(short.to_string().contains("at least 8"), "{short}");
        let missing = named("nope0000").unwrap_err();
        assert_eq!(missing.status(), StatusCode::NOT_FOUND);
        assert!(missing.to_string().contains("--history=10"), "{missing}");
        // Under eight characters: 400, whether it begins a version or not.
        for given in ["", "abc", "nope", "fedcba9"] {
            let short = named(given).unwrap_err();
            assert_eq!(short.status(), StatusCode::BAD_REQUEST, "{given:?}: {short}");
        }
    }
}
