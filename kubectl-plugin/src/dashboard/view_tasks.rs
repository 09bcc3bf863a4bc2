//! The tasks page and the dead letters page: a filtered, paged list.
//! Paging is done here, not in the browser: with 10,000 tasks the page
//! receives one page of rows, never the whole namespace.

use std::collections::BTreeMap;

use batchlease_api::{BatchTask, TaskPhase};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use serde::{Deserialize, Serialize};

use super::snapshot::{Snapshot, phase};
use crate::age;

/// Rows per page unless asked otherwise.
pub const DEFAULT_LIMIT: usize = 100;
/// The most rows one request returns.
pub const MAX_LIMIT: usize = 500;

/// What the tasks page asks for (its URL's query).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct TaskQuery {
    pub namespace: Option<String>,
    pub queue: Option<String>,
    /// A phase, or `DeadLetters` for `DeadLettered` and `Rejected`.
    pub phase: Option<String>,
    /// A label selector of equalities and existence: `a=b,c`.
    pub label: Option<String>,
    /// A substring of the task's name.
    pub q: Option<String>,
    pub offset: Option<usize>,
    pub limit: Option<usize>,
}

/// Why a query cannot be answered (shown to the user as it is).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    #[error(
        "unknown phase {0:?}: one of Pending, Ready, Running, Succeeded, DeadLettered, Rejected, Cancelled, DeadLetters"
    )]
    Phase(String),
    #[error("label selector {0:?}: use key=value or key, separated by commas")]
    Label(String),
}

/// One row of the list.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskRow {
    pub namespace: String,
    pub name: String,
    pub queue: String,
    pub phase: &'static str,
    pub token: i64,
    pub attempts: i32,
    pub holder: Option<String>,
    pub age_seconds: Option<i64>,
    /// The last failure's reason (and message, for dead letters).
    pub last_failure: Option<String>,
    pub last_failure_message: Option<String>,
    /// The task can be redriven (DeadLettered or Rejected).
    pub redrivable: bool,
}

/// A page of rows and how many matched in all.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TaskPage {
    pub total: usize,
    pub offset: usize,
    pub limit: usize,
    pub rows: Vec<TaskRow>,
}

enum PhaseFilter {
    Any,
    One(TaskPhase),
    DeadLetters,
}

fn phase_filter(p: Option<&str>) -> Result<PhaseFilter, QueryError> {
    match p.filter(|p| !p.is_empty()) {
        None => Ok(PhaseFilter::Any),
        Some("DeadLetters") => Ok(PhaseFilter::DeadLetters),
        Some(p) => TaskPhase::ALL
            .into_iter()
            .find(|x| x.as_str() == p)
            .map(PhaseFilter::One)
            .ok_or_else(|| QueryError::Phase(p.to_owned())),
    }
}

/// `key=value` (equality) or `key` (existence) terms.
fn label_terms(s: Option<&str>) -> Result<Vec<(String, Option<String>)>, QueryError> {
    let Some(s) = s.filter(|s| !s.trim().is_empty()) else {
        return Ok(vec![]);
    };
    s.split(',')
        .map(|term| {
            let term = term.trim();
            let (k, v) = match term.split_once('=') {
                Some((k, v)) => (k.trim(), Some(v.trim().trim_start_matches('=').to_owned())),
                None => (term, None),
            };
            let bad = k.is_empty()
                || k.contains(['!', ' ', '(', ')'])
                || v.as_deref().is_some_and(|v| v.contains([' ', '!']));
            if bad {
                Err(QueryError::Label(s.to_owned()))
            } else {
                Ok((k.to_owned(), v))
            }
        })
        .collect()
}

fn row(t: &BatchTask, now: Timestamp) -> TaskRow {
    let st = t.status.clone().unwrap_or_default();
    let ph = phase(t);
    TaskRow {
        namespace: t.namespace().unwrap_or_default(),
        name: t.name_any(),
        queue: t.spec.queue.clone(),
        phase: ph.as_str(),
        token: st.fencing_token,
        attempts: st.attempts,
        holder: st.holder.clone(),
        age_seconds: t
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|c| age::seconds(c.0, now)),
        last_failure: st.last_failure.as_ref().map(|f| f.reason.clone()),
        last_failure_message: st.last_failure.as_ref().map(|f| f.message.clone()),
        redrivable: matches!(ph, TaskPhase::DeadLettered | TaskPhase::Rejected),
    }
}

/// The page of tasks `query` asks for: newest first (then by name), so a
/// user looking at a busy queue sees what just arrived.
pub fn tasks(snap: &Snapshot, query: &TaskQuery, now: Timestamp) -> Result<TaskPage, QueryError> {
    let phase_f = phase_filter(query.phase.as_deref())?;
    let labels = label_terms(query.label.as_deref())?;
    let empty = BTreeMap::new();
    let nonempty = |o: &Option<String>| o.as_deref().filter(|s| !s.is_empty()).map(str::to_owned);
    let (ns, queue, needle) = (
        nonempty(&query.namespace),
        nonempty(&query.queue),
        nonempty(&query.q),
    );
    let mut hits: Vec<&BatchTask> = snap
        .tasks
        .iter()
        .map(|t| &**t)
        .filter(|t| {
            ns.as_ref()
                .is_none_or(|n| t.namespace().as_ref() == Some(n))
        })
        .filter(|t| queue.as_ref().is_none_or(|q| &t.spec.queue == q))
        .filter(|t| match phase_f {
            PhaseFilter::Any => true,
            PhaseFilter::One(p) => phase(t) == p,
            PhaseFilter::DeadLetters => {
                matches!(phase(t), TaskPhase::DeadLettered | TaskPhase::Rejected)
            }
        })
        .filter(|t| {
            let have = t.metadata.labels.as_ref().unwrap_or(&empty);
            labels.iter().all(|(k, v)| match v {
                Some(v) => have.get(k) == Some(v),
                None => have.contains_key(k),
            })
        })
        .filter(|t| {
            needle
                .as_ref()
                .is_none_or(|n| t.name_any().contains(n.as_str()))
        })
        .collect();
    hits.sort_by(|a, b| {
        let created = |t: &BatchTask| t.metadata.creation_timestamp.as_ref().map(|c| c.0);
        created(b)
            .cmp(&created(a))
            .then_with(|| a.metadata.namespace.cmp(&b.metadata.namespace))
            .then_with(|| a.metadata.name.cmp(&b.metadata.name))
    });
    let limit = query.limit.unwrap_or(DEFAULT_LIMIT).clamp(1, MAX_LIMIT);
    // Past the end (tasks deleted while a late page was shown): the last
    // page, not an empty one without a way back.
    let last_page = hits.len().saturating_sub(1) / limit * limit;
    let offset = query.offset.unwrap_or(0).min(last_page);
    Ok(TaskPage {
        total: hits.len(),
        offset,
        limit,
        rows: hits
            .into_iter()
            .skip(offset)
            .take(limit)
            .map(|t| row(t, now))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::fixtures::{task, ts};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn snap() -> Snapshot {
        let mk =
            |name: &str, queue: &str, p: TaskPhase, created: i64, label: Option<(&str, &str)>| {
                let mut t = task(name, queue, p, |_| {});
                t.metadata.creation_timestamp = Some(Time(ts(created)));
                if let Some((k, v)) = label {
                    t.metadata.labels = Some(BTreeMap::from([(k.to_owned(), v.to_owned())]));
                }
                Arc::new(t)
            };
        Snapshot {
            tasks: vec![
                mk("a", "q", TaskPhase::Running, 1, Some(("team", "red"))),
                mk("b", "q", TaskPhase::DeadLettered, 2, Some(("team", "blue"))),
                mk("c", "q", TaskPhase::Rejected, 3, None),
                mk("d", "other", TaskPhase::Succeeded, 4, Some(("team", "red"))),
                mk("ab", "other", TaskPhase::Ready, 5, None),
            ],
            ..Default::default()
        }
    }

    fn names(q: TaskQuery) -> Result<(usize, Vec<String>), QueryError> {
        let p = tasks(&snap(), &q, ts(100))?;
        Ok((p.total, p.rows.into_iter().map(|r| r.name).collect()))
    }

    fn s(x: &str) -> Option<String> {
        Some(x.to_owned())
    }

    #[test]
    fn filters_combine_and_the_newest_come_first() {
        let cases: Vec<(TaskQuery, (usize, Vec<&str>))> = vec![
            (TaskQuery::default(), (5, vec!["ab", "d", "c", "b", "a"])),
            (
                TaskQuery {
                    queue: s("q"),
                    ..Default::default()
                },
                (3, vec!["c", "b", "a"]),
            ),
            (
                TaskQuery {
                    phase: s("DeadLetters"),
                    ..Default::default()
                },
                (2, vec!["c", "b"]),
            ),
            (
                TaskQuery {
                    phase: s("Running"),
                    ..Default::default()
                },
                (1, vec!["a"]),
            ),
            (
                TaskQuery {
                    label: s("team=red"),
                    ..Default::default()
                },
                (2, vec!["d", "a"]),
            ),
            (
                TaskQuery {
                    label: s("team"),
                    ..Default::default()
                },
                (3, vec!["d", "b", "a"]),
            ),
            (
                TaskQuery {
                    label: s("team=red"),
                    queue: s("q"),
                    ..Default::default()
                },
                (1, vec!["a"]),
            ),
            (
                TaskQuery {
                    q: s("a"),
                    ..Default::default()
                },
                (2, vec!["ab", "a"]),
            ),
            (
                TaskQuery {
                    namespace: s("elsewhere"),
                    ..Default::default()
                },
                (0, vec![]),
            ),
            // Empty fields (an HTML form's) mean no filter.
            (
                TaskQuery {
                    queue: s(""),
                    phase: s(""),
                    label: s(""),
                    q: s(""),
                    ..Default::default()
                },
                (5, vec!["ab", "d", "c", "b", "a"]),
            ),
        ];
        for (q, (total, want)) in cases {
            let got = names(q.clone());
            assert_eq!(
                got,
                Ok((total, want.iter().map(|s| s.to_string()).collect())),
                "{q:?}"
            );
        }
    }

    #[test]
    fn pages_are_bounded_and_an_offset_past_the_end_is_the_last_page() {
        let p = tasks(
            &snap(),
            &TaskQuery {
                offset: Some(1),
                limit: Some(2),
                ..Default::default()
            },
            ts(9),
        );
        let p = p.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((p.total, p.offset, p.limit, p.rows.len()), (5, 1, 2, 2));
        assert_eq!(p.rows[0].name, "d");
        let p = tasks(
            &snap(),
            &TaskQuery {
                offset: Some(50),
                limit: Some(100_000),
                ..Default::default()
            },
            ts(9),
        );
        let p = p.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (p.total, p.offset, p.limit, p.rows.len()),
            (5, 0, MAX_LIMIT, 5)
        );
        let q = |offset, limit| TaskQuery {
            offset: Some(offset),
            limit: Some(limit),
            ..Default::default()
        };
        let p = tasks(&snap(), &q(9, 2), ts(9)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((p.offset, p.rows.len()), (4, 1), "the last page");
        let p = tasks(&Snapshot::default(), &q(9, 2), ts(9)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((p.total, p.offset, p.rows.len()), (0, 0, 0));
    }

    #[test]
    fn bad_phases_and_selectors_are_refused_with_what_is_accepted() {
        let e = names(TaskQuery {
            phase: s("Done"),
            ..Default::default()
        });
        assert!(
            matches!(&e, Err(QueryError::Phase(p)) if p == "Done"),
            "{e:?}"
        );
        assert!(
            e.err()
                .map(|e| e.to_string())
                .unwrap_or_default()
                .contains("DeadLettered")
        );
        for bad in ["team!=red", "=red", "a,,b", "team in (a)"] {
            let e = names(TaskQuery {
                label: s(bad),
                ..Default::default()
            });
            assert!(matches!(e, Err(QueryError::Label(_))), "{bad}: {e:?}");
        }
    }

    #[test]
    fn a_dead_letter_row_says_why_and_that_it_can_be_redriven() {
        let mut t = task("x", "q", TaskPhase::DeadLettered, |s| {
            s.last_failure = Some(batchlease_api::Failure {
                reason: "BadInput".into(),
                message: "no such file".into(),
                token: 4,
                time: Time(ts(3)),
            });
            s.fencing_token = 4;
            s.attempts = 4;
        });
        t.metadata.creation_timestamp = Some(Time(ts(0)));
        let r = row(&t, ts(90));
        assert_eq!(r.last_failure.as_deref(), Some("BadInput"));
        assert_eq!(r.last_failure_message.as_deref(), Some("no such file"));
        assert!(r.redrivable);
        assert_eq!((r.token, r.attempts, r.age_seconds), (4, 4, Some(90)));
    }
}
