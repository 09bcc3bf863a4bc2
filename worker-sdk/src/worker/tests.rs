//! Unit tests of the worker's builder and its pure helpers.

use super::builder::{checkpoint_interval_from_env, identity_of, renew_per_worker_from_env};
use super::*;

fn config() -> kube::Config {
    kube::Config::new("http://127.0.0.1:1".parse().unwrap())
}

/// A 254-character identity made every claim fail with 422, which the
/// worker took for lost races: silently nothing ran.
#[tokio::test]
async fn build_refuses_an_identity_the_crd_would_refuse() {
    for bad in ["", &"w".repeat(254)] {
        let e = WorkerBuilder::new(config(), "ns")
            .queue("q")
            .identity(bad)
            .build()
            .unwrap_err();
        assert!(matches!(e, Error::Config(m) if m.contains("253")), "{e:?}");
    }
    let w = WorkerBuilder::new(config(), "ns")
        .queue("q")
        .identity("w".repeat(253))
        .build()
        .unwrap();
    assert_eq!(w.identity().len(), 253);
}

#[test]
fn build_outside_a_runtime_is_an_error_not_a_panic() {
    let e = WorkerBuilder::new(config(), "ns")
        .queue("q")
        .build()
        .unwrap_err();
    assert!(
        matches!(e, Error::Config(m) if m.contains("runtime")),
        "{e:?}"
    );
}

#[test]
fn renewals_per_worker_are_turned_on_by_1_or_true_and_off_by_0_or_false() {
    for (value, said) in [
        (None, None),
        (Some(""), None),
        (Some("yes"), None),
        (Some("0"), Some(false)),
        (Some("false"), Some(false)),
        (Some(" FALSE "), Some(false)),
        (Some("1"), Some(true)),
        (Some("true"), Some(true)),
        (Some(" TRUE "), Some(true)),
    ] {
        assert_eq!(renew_per_worker_from_env(value), said, "{value:?}");
    }
}

#[test]
fn the_checkpoint_interval_is_read_from_a_positive_number_of_seconds() {
    let s = Duration::from_secs_f64;
    for (value, want) in [
        (None, None),
        (Some("60"), Some(s(60.0))),
        (Some(" 2.5 "), Some(s(2.5))),
        (Some("0"), None),
        (Some("-3"), None),
        (Some("NaN"), None),
        (Some("inf"), None),
        (Some("1m"), None),
    ] {
        assert_eq!(checkpoint_interval_from_env(value), want, "{value:?}");
    }
}

#[test]
fn the_default_identity_is_the_pod_then_a_suffix() {
    assert_eq!(identity_of(Some("w-0"), Some("h"), 0xab), "w-0/0000ab");
    assert_eq!(identity_of(None, Some("w-1"), 1), "w-1/000001");
    assert_eq!(identity_of(Some(""), Some("w-1"), 1), "w-1/000001");
    assert_eq!(identity_of(None, None, 0xff_fffe), "worker/fffffe");
}
