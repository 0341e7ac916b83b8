//! The numbers jobs are given, each refused in words: the value parsers of the numeric flags
//! (the shared ones in [`crate::job`] and each app's own), and the timeout the distributed
//! runtime reads from `ENGINE_DIST_TIMEOUT` ([`crate::dist::launch`]), checked as `--timeout`
//! is. clap names the flag and the value in the error, so a NaN learning rate or a negative
//! timeout stops the command before it starts (a NaN rate would train to NaN weights and save
//! them; a negative timeout would panic in Duration).

/// A count within `range` (a `usize` flag), refused in words: "must be at least 1", "must be
/// from 0 to 2" (clap's ranged parser says "0 is not in 1..18446744073709551615").
pub fn count(range: impl std::ops::RangeBounds<u64>) -> impl clap::builder::TypedValueParser<Value = usize> {
    use std::ops::Bound;
    let low = match range.start_bound() {
        Bound::Included(&n) => n,
        Bound::Excluded(&n) => n.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let high = match range.end_bound() {
        Bound::Included(&n) => Some(n),
        Bound::Excluded(&n) => Some(n.saturating_sub(1)),
        Bound::Unbounded => None,
    };
    move |s: &str| -> std::result::Result<usize, String> {
        let digits = !s.trim().is_empty() && s.trim().bytes().all(|b| b.is_ascii_digit());
        let n: u64 = s.trim().parse().map_err(|_| if digits { "is too large" } else { "must be a whole number" })?;
        if n >= low && high.is_none_or(|high| n <= high) {
            return usize::try_from(n).map_err(|_| "is too large".to_string());
        }
        Err(match high {
            None => format!("must be at least {low}"),
            Some(high) => format!("must be from {low} to {high}"),
        })
    }
}

/// A finite number.
pub fn finite(s: &str) -> std::result::Result<f64, String> {
    let x: f64 = s.trim().parse().map_err(|e| format!("{e}"))?;
    if x.is_finite() {
        Ok(x)
    } else {
        Err("must be a finite number".into())
    }
}

/// A finite number above 0.
pub fn positive(s: &str) -> std::result::Result<f64, String> {
    finite(s).and_then(|x| if x > 0.0 { Ok(x) } else { Err("must be above 0".into()) })
}

/// A finite number of at least 0.
pub fn non_negative(s: &str) -> std::result::Result<f64, String> {
    finite(s).and_then(|x| if x >= 0.0 { Ok(x) } else { Err("must be at least 0".into()) })
}

/// A finite number from 0 to 1.
pub fn share(s: &str) -> std::result::Result<f64, String> {
    finite(s).and_then(|x| if (0.0..=1.0).contains(&x) { Ok(x) } else { Err("must be from 0 to 1".into()) })
}

/// A finite number above 0 and at most 1.
pub fn positive_share(s: &str) -> std::result::Result<f64, String> {
    positive(s).and_then(|x| if x <= 1.0 { Ok(x) } else { Err("must be above 0 and at most 1".into()) })
}

/// A timeout in seconds: above 0 and at most a year (c10d counts its timeouts in
/// milliseconds).
pub fn seconds(s: &str) -> std::result::Result<f64, String> {
    const YEAR: f64 = 365.0 * 24.0 * 3600.0;
    positive(s).and_then(|x| if x <= YEAR { Ok(x) } else { Err(format!("must be at most {YEAR} (a year)")) })
}
