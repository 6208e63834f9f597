//! The one shape of the mesh's plain names (sections, modules, grant
//! requirements, provisioned resources): a length range, what may come
//! first, what may follow, and the error that says so, naming the field.

use std::ops::RangeInclusive;

use crate::DecodeError;

/// A rule for a plain name.
pub(crate) struct NameRule {
    pub len: RangeInclusive<usize>,
    pub first: fn(u8) -> bool,
    pub rest: fn(u8) -> bool,
    /// How the error says the rule, after the name: "1 to 48 characters of …".
    pub says: &'static str,
    /// How much of a bad name the error quotes.
    pub quote: usize,
}

fn lower_digit_dash(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'
}

fn lower_digit_underscore(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'
}

fn lower_or_digit(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit()
}

/// Section names on the wire, known or not.
pub(crate) const SECTION: NameRule = NameRule {
    len: 1..=32,
    first: |b| b.is_ascii_lowercase(),
    rest: lower_digit_underscore,
    says: "1 to 32 characters of a-z 0-9 _ starting with a letter",
    quote: 64,
};

/// Module names.
pub(crate) const MODULE: NameRule = NameRule {
    len: 1..=48,
    first: lower_or_digit,
    rest: lower_digit_dash,
    says: "1 to 48 characters of a-z 0-9 -, starting with a letter or digit",
    quote: 80,
};

/// A requirement's name within its module.
pub(crate) const REQUIREMENT: NameRule = NameRule {
    len: 1..=32,
    first: |b| b.is_ascii_lowercase(),
    rest: lower_digit_dash,
    says: "1 to 32 characters of a-z 0-9 -, starting with a letter",
    quote: 64,
};

/// A database, vhost, bucket or user on a provider's server (the bucket rules).
pub(crate) const RESOURCE: NameRule = NameRule {
    len: 3..=63,
    first: lower_or_digit,
    rest: lower_digit_dash,
    says: "3 to 63 characters of a-z 0-9 -, starting with a letter or digit",
    quote: 80,
};

/// Check `name` against `rule`; the error names `field` and quotes the name.
pub(crate) fn check(field: &str, name: &str, rule: &NameRule) -> Result<(), DecodeError> {
    let bytes = name.as_bytes();
    let ok = rule.len.contains(&bytes.len())
        && bytes.first().is_some_and(|b| (rule.first)(*b))
        && bytes.iter().all(|b| (rule.rest)(*b));
    if ok {
        return Ok(());
    }
    Err(DecodeError::invalid(
        field,
        format!(
            "`{}`: {}",
            name.chars().take(rule.quote).collect::<String>(),
            rule.says
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rule_takes_its_names_and_says_why_not() {
        assert!(check("f", "web-1", &MODULE).is_ok());
        assert!(check("f", "1web", &MODULE).is_ok());
        assert!(check("f", "1main", &REQUIREMENT).is_err());
        assert!(check("f", "ab", &RESOURCE).is_err());
        assert!(check("f", &"a".repeat(63), &RESOURCE).is_ok());
        assert!(check("f", "new_section", &SECTION).is_ok());
        assert!(check("f", "new-section", &SECTION).is_err());
        let e = check("module", "Web", &MODULE).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid field `module`: `Web`: 1 to 48 characters of a-z 0-9 -, starting with a letter or digit"
        );
    }
}
