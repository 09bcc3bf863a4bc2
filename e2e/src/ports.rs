//! Loopback TCP ports for the processes a test starts.
//!
//! The operator and the demo worker are separate binaries told their port
//! on the command line (`--metrics-addr`), and the tests need to know it,
//! so we cannot hand them a bound listener or let them bind port 0: there
//! is always a window between finding a free port and the child binding
//! it. The naive "bind port 0, drop the listener, return the port" goes
//! wrong in that window: the kernel picks port 0 at random among the free
//! ephemeral ports and ours is free again, so another thread of the same
//! test binary (cargo runs tests in parallel) or another test binary gets
//! the same port — a few hundred calls in one process all but surely see
//! a repeat.
//!
//! So every port is *claimed* before it is handed out, for the rest of the
//! process's life (a restarted child reuses its port): an abstract Unix
//! socket named after the port. The kernel lets a name exist once per
//! network namespace (the scope of loopback ports too) and removes it when
//! the process exits, however it exits, so there are no lock files to
//! clean up or to go stale. A port claimed by this or another e2e process
//! is skipped. What is left is a foreign process binding the port in the
//! window, which is unlikely (its own port 0 is a random pick among tens
//! of thousands) and loud: the child fails to bind and the test fails.

use std::collections::BTreeMap;
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::sync::{LazyLock, Mutex, PoisonError};

use anyhow::Context;

/// Candidates tried before giving up; each is skipped only when another
/// claim has it, so running out means something is badly wrong.
const ATTEMPTS: usize = 100;

/// The claims of this process; see the module docs.
static PORTS: LazyLock<Registry> = LazyLock::new(|| Registry::new("batchlease-e2e-port"));

/// A TCP port on 127.0.0.1 that nothing listens on now and that no other
/// caller of this function, in this process or another, gets (see the
/// module docs for why and for what is left).
pub fn free_port() -> anyhow::Result<u16> {
    PORTS.take(kernel_pick)
}

/// A port the kernel considers free right now (it is free again when this
/// returns: that is the window the claims cover).
fn kernel_pick() -> io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

/// Ports handed out, each held by its claim socket until the process ends.
#[derive(Debug)]
struct Registry {
    /// Prefix of the claim names (tests use their own so they cannot meet
    /// real claims).
    scope: String,
    claims: Mutex<BTreeMap<u16, UnixDatagram>>,
}

impl Registry {
    fn new(scope: &str) -> Self {
        Self {
            scope: scope.to_owned(),
            claims: Mutex::new(BTreeMap::new()),
        }
    }

    /// The first port from `candidate` that nobody has claimed, claimed.
    fn take(&self, mut candidate: impl FnMut() -> io::Result<u16>) -> anyhow::Result<u16> {
        // The map is only ever inserted into: a panic elsewhere cannot have
        // left it half-updated, so a poisoned lock is still good.
        let mut claims = self.claims.lock().unwrap_or_else(PoisonError::into_inner);
        for _ in 0..ATTEMPTS {
            let port = candidate().context("finding a free loopback port")?;
            if claims.contains_key(&port) {
                continue;
            }
            let name = format!("{}-{port}", self.scope);
            let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
            match UnixDatagram::bind_addr(&addr) {
                Ok(claim) => {
                    claims.insert(port, claim);
                    return Ok(port);
                }
                // Another process holds this port.
                Err(e) if e.kind() == io::ErrorKind::AddrInUse => {}
                Err(e) => return Err(e).with_context(|| format!("claiming port {port} (@{name})")),
            }
        }
        anyhow::bail!("no unclaimed loopback port in {ATTEMPTS} tries")
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    /// A scope of claim names of this test alone.
    fn registry(test: &str) -> Registry {
        Registry::new(&format!(
            "batchlease-e2e-port-test-{}-{test}",
            std::process::id()
        ))
    }

    /// A candidate source that yields `ports` in order.
    fn scripted(ports: &[u16]) -> impl FnMut() -> io::Result<u16> {
        let mut it = ports.iter().copied();
        move || {
            it.next()
                .ok_or_else(|| io::Error::other("script exhausted"))
        }
    }

    /// The old `free_port` handed out repeats within a few hundred calls
    /// from parallel threads (the kernel's random pick meets a port that
    /// was handed out and dropped).
    #[test]
    fn free_port_never_hands_out_a_port_twice_across_threads() {
        let threads: Vec<_> = (0..8)
            .map(|_| {
                std::thread::spawn(|| (0..50).map(|_| free_port().unwrap()).collect::<Vec<u16>>())
            })
            .collect();
        let ports: Vec<u16> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        let distinct: BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "a port was handed out twice");
    }

    #[test]
    fn free_port_is_bindable() {
        let port = free_port().unwrap();
        TcpListener::bind((Ipv4Addr::LOCALHOST, port)).unwrap();
    }

    #[test]
    fn a_port_handed_out_before_is_skipped() {
        let r = registry("repeat");
        let mut source = scripted(&[7, 7, 9]);
        assert_eq!(r.take(&mut source).unwrap(), 7);
        assert_eq!(r.take(&mut source).unwrap(), 9);
    }

    #[test]
    fn a_port_claimed_by_another_process_is_skipped() {
        let r = registry("foreign");
        // What another e2e process holds for port 7 (the name is all that
        // matters, and it is the same whichever process binds it).
        let name = format!("{}-7", r.scope);
        let _other =
            UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap())
                .unwrap();
        assert_eq!(r.take(scripted(&[7, 9])).unwrap(), 9);
    }

    #[test]
    fn a_claim_lasts_as_long_as_the_registry() {
        let name = {
            let r = registry("lifetime");
            assert_eq!(r.take(scripted(&[7])).unwrap(), 7);
            let name = format!("{}-7", r.scope);
            let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
            let e = UnixDatagram::bind_addr(&addr).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
            name
        };
        // Dropped (as at process exit): the name is free again.
        UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    }

    #[test]
    fn gives_up_when_every_candidate_is_taken() {
        let r = registry("exhausted");
        assert_eq!(r.take(scripted(&[7])).unwrap(), 7);
        let err = r.take(|| Ok(7)).unwrap_err();
        assert!(err.to_string().contains("no unclaimed"), "{err:#}");
    }

    #[test]
    fn a_failing_candidate_source_is_an_error() {
        let r = registry("failing");
        assert!(r.take(scripted(&[])).is_err());
    }
}
