//! `mqstate-robustness check --history FILE`: every check of a run, again, on a history a failing
//! run saved, so a finding can be reduced and the checker changed without rerunning servers.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;

use crate::checks;
use crate::history::{Cmd, History, Op, Outcome};

/// Checks the history in `path` (only `key`'s operations, printed, if given); 1 when a check
/// failed, 0 when none did.
pub fn run(
    path: &Path,
    check_budget: u64,
    key: Option<&str>,
    timeline: Option<&Path>,
) -> anyhow::Result<i32> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut history: History = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a history.json", path.display()))?;
    if let Some(key) = key {
        history.ops.retain(|op| op.key == key);
        history.notifications.retain(|n| n.key == key);
        history.registrations.retain(|r| r.key == key);
        let start = history.incarnations.first().map_or(0, |i| i.started_us);
        let mut ops: Vec<&Op> = history.ops.iter().collect();
        ops.sort_by_key(|op| op.invoked_us);
        for op in ops {
            println!("{}", describe(op, start));
        }
    }
    let findings = checks::run_checks(&history, Duration::from_secs(check_budget));
    for v in &findings.violations {
        println!("{} {}: {}", v.check, v.key, v.detail);
    }
    println!(
        "check: {} operations, {} violations, {} acknowledged writes lost, {} incomplete",
        history.ops.len(),
        findings.violations.len(),
        findings.acked_lost,
        findings.incomplete.len()
    );
    if let Some(out) = timeline {
        std::fs::write(out, crate::timeline::render(0, &history, &findings))
            .with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(i32::from(!findings.violations.is_empty()))
}

/// One operation as a line: id, client, times in ms since the run started, command, outcome.
fn describe(op: &Op, start_us: u64) -> String {
    let ms = |us: u64| us.saturating_sub(start_us) as f64 / 1000.0;
    let returned = op
        .returned_us
        .map_or_else(|| "open".to_owned(), |r| format!("{:.3}", ms(r)));
    let argument = match &op.cmd {
        Cmd::Set { value, .. } | Cmd::VDel { value, .. } => value.as_str(),
        Cmd::Get | Cmd::Del { .. } => "",
    };
    let outcome = match &op.outcome {
        Outcome::Written(v) => format!("OK {v}"),
        Outcome::Hit { value, version } => format!("{value} @ {version}"),
        other => format!("{other:?}"),
    };
    format!(
        "#{} {} [{}] {:.3} -> {returned}  {} {} {argument}  => {outcome}",
        op.id,
        op.client,
        op.incarnation,
        ms(op.invoked_us),
        op.cmd.name(),
        op.key,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a run saves is what `check` reads: the same checks find the same violations.
    #[test]
    fn a_saved_history_reads_back_with_the_same_findings() {
        let history = crate::checks::tests::seed_7112_reg_4();
        let saved = serde_json::to_string(&history).unwrap();
        let read: History = serde_json::from_str(&saved).unwrap();
        assert_eq!(read.ops.len(), history.ops.len());
        assert_eq!(read.ops[1].version(), history.ops[1].version());
        let checks = |h: &History| {
            checks::run_checks(h, Duration::from_secs(10))
                .violations
                .iter()
                .map(|v| (v.check, v.key.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(checks(&read), checks(&history));
        assert!(!checks(&read).is_empty());
    }

    #[test]
    fn a_file_that_is_not_a_history_is_named() {
        let dir = std::env::temp_dir().join(format!("lin18-recheck-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("history.json");
        std::fs::write(&path, "{\"ops\": 3}").unwrap();
        let err = run(&path, 1, None, None).unwrap_err();
        assert!(
            format!("{err:#}").contains("is not a history.json"),
            "{err:#}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
