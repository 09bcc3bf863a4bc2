//! Who must be looked at again when a task changes (design §5).
//!
//! The controller reconciles a task when *it* changes. A dependent must
//! also be reconciled when one of its dependencies changes phase (it may
//! now run, or its dependency failed), and a task waiting for a resource
//! when another task that needs the resource changes phase (a lock was
//! released, or an older waiter was served). This index answers both
//! without rescanning the namespace: reverse edges by dependency *name*
//! (a dependency may not exist yet: creating it wakes its dependents) and
//! the tasks that need each resource.
//!
//! It is fed by the task watch, before the reflector store is updated, and
//! every event that changes a phase, a `dependsOn` or a `resources` list
//! sends the affected tasks to the controller's wake-up channel.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use batchlease_api::{BatchTask, TaskPhase};
use futures::channel::mpsc::UnboundedSender;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;

/// `(namespace, name)`.
type Key = (String, String);

#[derive(Debug, Default, Clone, PartialEq)]
struct Entry {
    phase: Option<TaskPhase>,
    depends_on: Vec<String>,
    resources: Vec<String>,
    /// Relist generation in which the entry was last seen.
    seen: u64,
}

#[derive(Debug, Default)]
struct Inner {
    tasks: HashMap<Key, Entry>,
    /// dependency (namespace, name) → names of the tasks that depend on it.
    dependents: HashMap<Key, BTreeSet<String>>,
    /// (namespace, resource) → names of the tasks that need it.
    users: HashMap<Key, BTreeSet<String>>,
    generation: u64,
}

/// The reverse-dependency and resource index, plus the wake-up channel.
#[derive(Debug)]
pub struct GraphIndex {
    inner: Mutex<Inner>,
    wake: UnboundedSender<ObjectRef<BatchTask>>,
}

impl GraphIndex {
    /// An empty index that sends wake-ups to `wake`.
    pub fn new(wake: UnboundedSender<ObjectRef<BatchTask>>) -> Self {
        Self {
            inner: Mutex::default(),
            wake,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain maps behind: still
        // usable, so a poisoned lock is taken over.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A task was added or changed: update the index and wake whoever the
    /// change concerns.
    pub fn apply(&self, task: &BatchTask) {
        let ns = task.namespace().unwrap_or_default();
        let name = task.name_any();
        let new = Entry {
            phase: task.status.as_ref().and_then(|s| s.phase),
            depends_on: task.spec.depends_on.clone(),
            resources: task.spec.resources.clone(),
            seen: 0,
        };
        let wake = {
            let mut inner = self.lock();
            let generation = inner.generation;
            let key = (ns.clone(), name.clone());
            let old = inner.tasks.get(&key).cloned();
            let mut wake = BTreeSet::new();
            let unchanged = old.as_ref().is_some_and(|o| {
                o.phase == new.phase
                    && o.depends_on == new.depends_on
                    && o.resources == new.resources
            });
            if !unchanged {
                if let Some(o) = &old {
                    inner.unlink(&ns, &name, o);
                }
                inner.link(&ns, &name, &new);
                wake.extend(inner.concerned(&ns, &name, old.as_ref(), &new));
            }
            inner.tasks.insert(
                key,
                Entry {
                    seen: generation,
                    ..new
                },
            );
            wake
        };
        self.send(&ns, wake);
    }

    /// A task was deleted: its dependents and resource users are woken
    /// (a dependency went missing; its locks are free to take over).
    pub fn delete(&self, task: &BatchTask) {
        let ns = task.namespace().unwrap_or_default();
        let name = task.name_any();
        let wake = self.lock().remove(&ns, &name);
        self.send(&ns, wake);
    }

    /// A relist begins: entries not seen again before [`Self::list_done`]
    /// were deleted while the watch was down.
    pub fn list_started(&self) {
        self.lock().generation += 1;
    }

    /// A relist ended: forget (and wake the dependents of) what it did not
    /// deliver.
    pub fn list_done(&self) {
        let gone: Vec<(Key, BTreeSet<String>)> = {
            let mut inner = self.lock();
            let generation = inner.generation;
            let stale: Vec<Key> = inner
                .tasks
                .iter()
                .filter(|(_, e)| e.seen != generation)
                .map(|(k, _)| k.clone())
                .collect();
            stale
                .into_iter()
                .map(|(ns, name)| {
                    let wake = inner.remove(&ns, &name);
                    ((ns, name), wake)
                })
                .collect()
        };
        for ((ns, _), wake) in gone {
            self.send(&ns, wake);
        }
    }

    /// Names of the tasks in `namespace` that need `resource`.
    pub fn users_of(&self, namespace: &str, resource: &str) -> BTreeSet<String> {
        self.lock()
            .users
            .get(&(namespace.to_owned(), resource.to_owned()))
            .cloned()
            .unwrap_or_default()
    }

    /// Wakes the `Pending` tasks that need one of `resources` (after this
    /// process released locks: no task event tells them).
    pub fn wake_users(&self, namespace: &str, resources: &[String]) {
        let wake = {
            let inner = self.lock();
            inner.pending_users(namespace, resources)
        };
        self.send(namespace, wake);
    }

    fn send(&self, namespace: &str, names: BTreeSet<String>) {
        for name in names {
            // The receiver lives as long as the controller; a closed
            // channel means it is shutting down.
            let _ = self
                .wake
                .unbounded_send(ObjectRef::new(&name).within(namespace));
        }
    }
}

impl Inner {
    fn link(&mut self, ns: &str, name: &str, e: &Entry) {
        for d in &e.depends_on {
            self.dependents
                .entry((ns.to_owned(), d.clone()))
                .or_default()
                .insert(name.to_owned());
        }
        for r in &e.resources {
            self.users
                .entry((ns.to_owned(), r.clone()))
                .or_default()
                .insert(name.to_owned());
        }
    }

    fn unlink(&mut self, ns: &str, name: &str, e: &Entry) {
        for (map, keys) in [
            (&mut self.dependents, &e.depends_on),
            (&mut self.users, &e.resources),
        ] {
            for k in keys {
                let key = (ns.to_owned(), k.clone());
                if let Some(set) = map.get_mut(&key) {
                    set.remove(name);
                    if set.is_empty() {
                        map.remove(&key);
                    }
                }
            }
        }
    }

    /// Who to wake when `name` changed from `old` to `new`: its dependents
    /// when its phase changed; the waiting users of its resources when it
    /// may have released a lock (it left `Ready`/`Running`) or its
    /// resources changed. A task that only *becomes* `Ready` releases
    /// nothing (it took its locks), and waking every waiting user of its
    /// resources on each phase change would make each of them re-read its
    /// locks for nothing.
    fn concerned(
        &self,
        ns: &str,
        name: &str,
        old: Option<&Entry>,
        new: &Entry,
    ) -> BTreeSet<String> {
        let mut wake = BTreeSet::new();
        let phase_changed = old.is_none_or(|o| o.phase != new.phase);
        if phase_changed && let Some(ds) = self.dependents.get(&(ns.to_owned(), name.to_owned())) {
            wake.extend(ds.iter().cloned());
        }
        let leased =
            |p: Option<TaskPhase>| matches!(p, Some(TaskPhase::Ready | TaskPhase::Running));
        let released = old.is_some_and(|o| leased(o.phase) && !leased(new.phase));
        if released || old.is_some_and(|o| o.resources != new.resources) {
            // Old and new resources: a task that stopped needing one may
            // have stopped blocking its waiters.
            let mut resources = new.resources.clone();
            if let Some(o) = old {
                resources.extend(o.resources.iter().cloned());
            }
            wake.extend(self.pending_users(ns, &resources));
        }
        wake.remove(name);
        wake
    }

    fn pending_users(&self, ns: &str, resources: &[String]) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        for r in resources {
            let Some(users) = self.users.get(&(ns.to_owned(), r.clone())) else {
                continue;
            };
            for u in users {
                let pending = self
                    .tasks
                    .get(&(ns.to_owned(), u.clone()))
                    .is_some_and(|e| matches!(e.phase, Some(TaskPhase::Pending) | None));
                if pending {
                    out.insert(u.clone());
                }
            }
        }
        out
    }

    fn remove(&mut self, ns: &str, name: &str) -> BTreeSet<String> {
        let Some(old) = self.tasks.remove(&(ns.to_owned(), name.to_owned())) else {
            return BTreeSet::new();
        };
        self.unlink(ns, name, &old);
        let mut wake: BTreeSet<String> = self
            .dependents
            .get(&(ns.to_owned(), name.to_owned()))
            .cloned()
            .unwrap_or_default();
        wake.extend(self.pending_users(ns, &old.resources));
        wake.remove(name);
        wake
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use batchlease_api::{BatchTaskSpec, BatchTaskStatus};
    use futures::StreamExt;
    use futures::channel::mpsc::{UnboundedReceiver, unbounded};

    fn task(name: &str, deps: &[&str], resources: &[&str], phase: Option<TaskPhase>) -> BatchTask {
        let mut spec = BatchTaskSpec::for_queue("q");
        spec.depends_on = deps.iter().map(|s| s.to_string()).collect();
        spec.resources = resources.iter().map(|s| s.to_string()).collect();
        let mut t = BatchTask::new(name, spec);
        t.metadata.namespace = Some("ns".into());
        t.status = phase.map(|p| BatchTaskStatus {
            phase: Some(p),
            ..Default::default()
        });
        t
    }

    fn drain(rx: &mut UnboundedReceiver<ObjectRef<BatchTask>>) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(Some(r)) = rx.next().now_or_never() {
            out.push(r.name);
        }
        out.sort();
        out
    }

    use futures::FutureExt;

    #[test]
    fn phase_changes_wake_dependents_and_only_them() {
        let (tx, mut rx) = unbounded();
        let idx = GraphIndex::new(tx);
        idx.apply(&task("b", &["a"], &[], Some(TaskPhase::Pending)));
        idx.apply(&task("c", &["b"], &[], Some(TaskPhase::Pending)));
        idx.apply(&task("x", &[], &[], Some(TaskPhase::Pending)));
        drain(&mut rx);
        // A dependency created after its dependent wakes it.
        idx.apply(&task("a", &[], &[], None));
        assert_eq!(drain(&mut rx), vec!["b"]);
        // The same phase again (a status write that changed nothing the
        // graph cares about) wakes nobody.
        idx.apply(&task("a", &[], &[], None));
        assert!(drain(&mut rx).is_empty());
        idx.apply(&task("a", &[], &[], Some(TaskPhase::Succeeded)));
        assert_eq!(drain(&mut rx), vec!["b"]);
        idx.delete(&task("b", &["a"], &[], Some(TaskPhase::Pending)));
        assert_eq!(drain(&mut rx), vec!["c"]);
        // b's edge to a is gone with it.
        idx.apply(&task("a", &[], &[], Some(TaskPhase::Rejected)));
        assert!(drain(&mut rx).is_empty());
    }

    #[test]
    fn resource_users_are_woken_when_a_user_changes_phase_or_on_release() {
        let (tx, mut rx) = unbounded();
        let idx = GraphIndex::new(tx);
        idx.apply(&task("big", &[], &["r1", "r2"], Some(TaskPhase::Pending)));
        idx.apply(&task("small", &[], &["r2"], Some(TaskPhase::Pending)));
        idx.apply(&task("other", &[], &["r3"], Some(TaskPhase::Pending)));
        idx.apply(&task("done", &[], &["r1"], Some(TaskPhase::Succeeded)));
        drain(&mut rx);
        // Becoming Ready releases nothing: nobody to wake.
        idx.apply(&task("big", &[], &["r1", "r2"], Some(TaskPhase::Ready)));
        assert!(drain(&mut rx).is_empty());
        idx.apply(&task("big", &[], &["r1", "r2"], Some(TaskPhase::Running)));
        idx.apply(&task("big", &[], &["r1", "r2"], Some(TaskPhase::Pending)));
        assert_eq!(drain(&mut rx), vec!["small"], "a settled attempt released");
        idx.apply(&task("big", &[], &["r1", "r2"], Some(TaskPhase::Ready)));
        drain(&mut rx);
        idx.wake_users("ns", &["r1".into()]);
        // Only Pending users; "big" is Ready now, "done" finished.
        assert!(drain(&mut rx).is_empty());
        idx.wake_users("ns", &["r2".into(), "r3".into()]);
        assert_eq!(drain(&mut rx), vec!["other", "small"]);
        assert_eq!(
            idx.users_of("ns", "r1"),
            BTreeSet::from(["big".to_string(), "done".to_string()])
        );
    }

    #[test]
    fn a_relist_forgets_tasks_deleted_while_the_watch_was_down() {
        let (tx, mut rx) = unbounded();
        let idx = GraphIndex::new(tx);
        idx.apply(&task("a", &[], &[], Some(TaskPhase::Running)));
        idx.apply(&task("b", &["a"], &[], Some(TaskPhase::Pending)));
        drain(&mut rx);
        idx.list_started();
        idx.apply(&task("b", &["a"], &[], Some(TaskPhase::Pending)));
        idx.list_done();
        assert_eq!(drain(&mut rx), vec!["b"], "a vanished: b must look again");
        idx.list_started();
        idx.apply(&task("b", &["a"], &[], Some(TaskPhase::Pending)));
        idx.list_done();
        assert!(drain(&mut rx).is_empty());
    }
}
