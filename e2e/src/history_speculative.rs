//! Invariants of speculative execution over what PostgreSQL recorded
//! (design §6): the compensation log of every task of the namespace.
//!
//! - every compensation ended `RAN` or `KEPT`: none left `REGISTERED` or
//!   `RUNNING` (half-run: a zombie's undo cut short) or `FAILED`;
//! - `KEPT` only in the one round that committed: under the token the
//!   task's fenced row committed, and in one round of it;
//! - no compensation of the committed round ran (its side effects stand).
//!
//! "Ran exactly once" is the log's own rule (a claim moves `REGISTERED` to
//! `RUNNING` once); the demo's outbox lets a test check it on the side
//! effects themselves.

use std::collections::{BTreeMap, BTreeSet};

/// One compensation as the log ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compensation {
    pub task_uid: String,
    pub token: i64,
    pub round: i32,
    pub seq: i32,
    pub name: String,
    pub status: String,
}

/// Violations of the module's rules; `committed` maps a task UID to the
/// token its fenced row committed.
pub fn check_compensations(log: &[Compensation], committed: &BTreeMap<String, i64>) -> Vec<String> {
    let mut out = Vec::new();
    let mut kept_rounds: BTreeMap<&str, BTreeSet<(i64, i32)>> = BTreeMap::new();
    for c in log {
        let at = format!(
            "compensation {} #{} of task {} (token {}, round {})",
            c.name, c.seq, c.task_uid, c.token, c.round
        );
        match c.status.as_str() {
            "RAN" => {}
            "KEPT" => {
                if committed.get(&c.task_uid) != Some(&c.token) {
                    out.push(format!(
                        "{at} is KEPT but that token did not commit (committed: {:?})",
                        committed.get(&c.task_uid)
                    ));
                }
                kept_rounds
                    .entry(&c.task_uid)
                    .or_default()
                    .insert((c.token, c.round));
            }
            other => out.push(format!("{at} ended {other}, not RAN or KEPT")),
        }
    }
    for (uid, rounds) in &kept_rounds {
        if rounds.len() > 1 {
            out.push(format!(
                "task {uid}: rounds {rounds:?} all KEPT: two rounds committed"
            ));
        }
    }
    for c in log.iter().filter(|c| c.status == "RAN") {
        if kept_rounds
            .get(c.task_uid.as_str())
            .is_some_and(|r| r.contains(&(c.token, c.round)))
        {
            out.push(format!(
                "compensation {} of task {} ran in the round that committed (token {}, round {})",
                c.name, c.task_uid, c.token, c.round
            ));
        }
    }
    out
}

/// The compensation log of these tasks and the token each committed.
pub async fn read(
    uids: &BTreeSet<String>,
) -> anyhow::Result<(Vec<Compensation>, BTreeMap<String, i64>)> {
    let db = crate::pg::connect().await?;
    let ids: Vec<String> = uids.iter().cloned().collect();
    let rows = db
        .query(
            "SELECT task_id, token, round, seq, name, status FROM compensation_log
              WHERE task_id = ANY($1) ORDER BY task_id, token, round, seq",
            &[&ids],
        )
        .await?;
    let log = rows
        .iter()
        .map(|r| Compensation {
            task_uid: r.get(0),
            token: r.get(1),
            round: r.get(2),
            seq: r.get(3),
            name: r.get(4),
            status: r.get(5),
        })
        .collect();
    let committed = db
        .query(
            "SELECT task_id, committed_token FROM task_state
              WHERE task_id = ANY($1) AND committed_token IS NOT NULL",
            &[&ids],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    Ok((log, committed))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(token: i64, round: i32, seq: i32, status: &str) -> Compensation {
        Compensation {
            task_uid: "u".into(),
            token,
            round,
            seq,
            name: "cancel-notice".into(),
            status: status.into(),
        }
    }

    #[test]
    fn the_rules_catch_each_way_of_getting_it_wrong() {
        let committed: BTreeMap<String, i64> = [("u".to_owned(), 3)].into();
        let ok = [
            c(1, 0, 0, "RAN"),
            c(2, 0, 0, "RAN"),
            c(3, 0, 0, "RAN"),
            c(3, 1, 0, "KEPT"),
        ];
        assert_eq!(check_compensations(&ok, &committed), Vec::<String>::new());
        let cases: [(&[Compensation], &str); 5] = [
            (&[c(2, 0, 0, "RUNNING")], "ended RUNNING"),
            (&[c(2, 0, 0, "REGISTERED")], "ended REGISTERED"),
            (&[c(2, 0, 0, "KEPT")], "did not commit"),
            (
                &[c(3, 0, 0, "KEPT"), c(3, 1, 0, "KEPT")],
                "two rounds committed",
            ),
            (
                &[c(3, 0, 0, "KEPT"), c(3, 0, 1, "RAN")],
                "ran in the round that committed",
            ),
        ];
        for (log, want) in cases {
            let v = check_compensations(log, &committed);
            assert!(v.iter().any(|m| m.contains(want)), "{want}: {v:?}");
        }
    }
}
