//! In which order a worker tries the offered leases.
//!
//! Every worker used to try the oldest offer first: in a burst, all of them
//! raced for the same lease, one won and the rest paid a failed write (a
//! 409) each before moving to the next — ≈ 1.8 losing claims per task with
//! 3 workers × 4 slots (issue 12). Offers are now taken oldest *second*
//! first (the resolution of `creationTimestamp`, so a burst is one second),
//! and within a second in the order of a hash of (worker identity, lease
//! name): rendezvous hashing, each worker prefers a different offer of the
//! burst, and still every worker tries every offer. Fairness across
//! seconds stays FIFO; within one second it never was (equal timestamps).

use std::collections::HashSet;
use std::sync::Arc;

use batchlease_api::TaskLease;
use batchlease_api::names::short_hash;
use kube::ResourceExt;

/// `offers` in the order `identity` tries them, without those in `skip`
/// (leases this worker claimed moments ago, which its cache may still show
/// offered) and those addressed to another worker (`spec.offeredTo`: the
/// API server would refuse the claim).
pub fn claim_order(
    offers: Vec<Arc<TaskLease>>,
    identity: &str,
    skip: &HashSet<String>,
) -> Vec<Arc<TaskLease>> {
    let mut keyed: Vec<_> = offers
        .into_iter()
        .filter(|l| !skip.contains(&l.name_any()))
        .filter(|l| l.spec.offered_to.as_deref().is_none_or(|to| to == identity))
        .map(|l| {
            let second = l
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.as_second());
            let spread = short_hash(&format!("{identity}\0{}", l.name_any()));
            ((second, spread), l)
        })
        .collect();
    keyed.sort_by(|a, b| a.0.cmp(&b.0));
    keyed.into_iter().map(|(_, l)| l).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchlease_api::TaskLeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use k8s_openapi::jiff::Timestamp;

    fn offer(name: &str, second: i64) -> Arc<TaskLease> {
        let mut l = TaskLease::new(name, TaskLeaseSpec::offered(name, "uid", "q", 1, 30));
        l.metadata.creation_timestamp = Some(Time(Timestamp::from_second(second).unwrap()));
        Arc::new(l)
    }

    fn names(v: &[Arc<TaskLease>]) -> Vec<String> {
        v.iter().map(|l| l.name_any()).collect()
    }

    #[test]
    fn workers_prefer_different_offers_of_a_burst_and_older_seconds_first() {
        let burst: Vec<_> = (0..12).map(|i| offer(&format!("t{i}-1"), 100)).collect();
        let mut all = burst.clone();
        all.push(offer("old-1", 99));
        let firsts: HashSet<String> = (0..6)
            .map(|w| {
                let order = claim_order(all.clone(), &format!("worker-{w}"), &HashSet::new());
                assert_eq!(order.len(), 13, "every offer is tried");
                assert_eq!(order[0].name_any(), "old-1", "an older second first");
                order[1].name_any()
            })
            .collect();
        // Six workers, twelve offers in one second: their first choices in
        // the burst spread (all six on one would be the old herd).
        assert!(firsts.len() >= 4, "first choices {firsts:?}");
        // Deterministic per worker: the same order every time.
        let a = names(&claim_order(burst.clone(), "w", &HashSet::new()));
        let b = names(&claim_order(burst.clone(), "w", &HashSet::new()));
        assert_eq!(a, b);
    }

    #[test]
    fn leases_just_claimed_are_skipped() {
        let offers = vec![offer("a-1", 5), offer("b-1", 5)];
        let skip: HashSet<String> = ["a-1".to_owned()].into();
        assert_eq!(names(&claim_order(offers, "w", &skip)), vec!["b-1"]);
    }

    #[test]
    fn offers_addressed_to_another_worker_are_never_tried() {
        let to = |name: &str, w: Option<&str>| {
            let mut l = (*offer(name, 5)).clone();
            l.spec.offered_to = w.map(str::to_owned);
            Arc::new(l)
        };
        let offers = vec![
            to("mine-1", Some("w/1")),
            to("open-1", None),
            to("theirs-1", Some("w/2")),
        ];
        let mut got = names(&claim_order(offers, "w/1", &HashSet::new()));
        got.sort();
        assert_eq!(got, vec!["mine-1", "open-1"]);
    }
}
