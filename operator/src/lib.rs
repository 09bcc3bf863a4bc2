//! The operator's pure decision code, as a library: the binary's
//! reconcilers call it, and the model checker (`model/`) drives exactly
//! this code through every interleaving of a small cluster. Not a public
//! API: it follows the operator's needs, and picks the binary's
//! `k8s-openapi` version.

pub mod backoff;
pub mod decide;
pub mod deps;
pub mod fit;
pub mod leader_step;
pub mod lease_build;
pub mod locks;
pub mod observe;
pub mod offers;
pub mod queue_gate;
pub mod revocation;
pub mod spawn_gate;
pub mod speculation;
pub mod status;
pub mod worker_leases;
