//! Durations and sizes: the units the config is written in, parsed and formatted back.

use std::time::Duration;

/// Parses `250ms`, `10s`, `5m`, `24h`, `7d` (one number and one unit).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("'{s}' has no unit: write e.g. 250ms, 10s, 5m, 24h or 7d"))?;
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a duration: write e.g. 250ms, 10s, 5m, 24h or 7d"))?;
    let ms = match unit {
        "ms" => Some(n),
        "s" => n.checked_mul(1000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        "d" => n.checked_mul(86_400_000),
        _ => {
            return Err(format!(
                "'{s}' has an unknown unit '{unit}': use ms, s, m, h or d"
            ));
        }
    }
    .ok_or_else(|| format!("'{s}' is too large"))?;
    Ok(Duration::from_millis(ms))
}

/// Parses `512`, `512B`, `64KiB`, `1MiB`, `1GiB` (also `KB`, `MB`, `GB` as powers of 1000).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size: write e.g. 64KiB or 1MiB"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "'{s}' has an unknown unit '{other}': use B, KiB, MiB or GiB"
            ));
        }
    };
    n.checked_mul(mult)
        .and_then(|v| usize::try_from(v).ok())
        .ok_or_else(|| format!("'{s}' is too large"))
}

/// Formats a duration the way the config writes it.
pub fn fmt_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms.is_multiple_of(3_600_000) && ms > 0 {
        format!("{}h", ms / 3_600_000)
    } else if ms.is_multiple_of(60_000) && ms > 0 {
        format!("{}m", ms / 60_000)
    } else if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// Formats a byte size the way the config writes it: in the largest of `GiB`, `MiB` and
/// `KiB` that divides it (`1MiB`, `64KiB`), otherwise in bytes (`1000B`, `0B`).
pub fn fmt_size(bytes: usize) -> String {
    const UNITS: [(usize, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (unit, name) in UNITS {
        if bytes >= unit && bytes.is_multiple_of(unit) {
            return format!("{}{name}", bytes / unit);
        }
    }
    format!("{bytes}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes_parse() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("24h").unwrap(), Duration::from_secs(86400));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("10x").is_err());
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("1MiB").unwrap(), 1 << 20);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("1ZiB").is_err());
    }

    #[test]
    fn durations_and_sizes_format_as_the_config_writes_them_and_parse_back() {
        for (d, text) in [
            (Duration::from_millis(500), "500ms"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::from_secs(2), "2s"),
            (Duration::ZERO, "0s"),
            (Duration::from_secs(90), "90s"),
            (Duration::from_secs(300), "5m"),
            (Duration::from_secs(86400), "24h"),
        ] {
            assert_eq!(fmt_duration(d), text);
            assert_eq!(parse_duration(text).unwrap(), d, "{text}");
        }
        for (n, text) in [
            (0, "0B"),
            (100, "100B"),
            (1000, "1000B"),
            (8192, "8KiB"),
            (1 << 20, "1MiB"),
            (1536 * 1024, "1536KiB"),
            (256 << 20, "256MiB"),
            (1 << 30, "1GiB"),
        ] {
            assert_eq!(fmt_size(n), text);
            assert_eq!(parse_size(text).unwrap(), n, "{text}");
        }
    }
}
