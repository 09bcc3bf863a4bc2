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
//! It is fed by the task watch *after* the reflector store is updated (a
//! woken task must read the change that woke it), and every event that
//! changes a phase, a `dependsOn` or a `resources` list sends the affected
//! tasks to the controller's wake-up channel. During a relist the store
//! swaps in the new list only at its end, so wake-ups are held until then.
//!
//! It also keeps what the reconciler remembers per task between passes
//! (when it began taking locks, the last blocker it reported, the graph
//! generation at which the task was last found on no cycle), so all of it
//! is forgotten with the task.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use batchlease_api::{BatchTask, TaskPhase};
use futures::channel::mpsc::UnboundedSender;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;
use tokio::time::Instant;

/// `(namespace, name)`.
type Key = (String, String);

#[derive(Debug, Default, Clone, PartialEq)]
struct Entry {
    phase: Option<TaskPhase>,
    depends_on: Vec<String>,
    resources: Vec<String>,
    /// The BatchTask that is its controlling owner (a spawned child's
    /// parent).
    parent: Option<String>,
    /// Relist generation in which the entry was last seen.
    seen: u64,
}

/// What the reconciler remembers of a task between passes.
#[derive(Debug, Default, Clone)]
struct Scratch {
    lock_wait_since: Option<Instant>,
    blocker: Option<String>,
    no_cycle_at: Option<u64>,
}

#[derive(Debug, Default)]
struct Inner {
    tasks: HashMap<Key, Entry>,
    /// dependency (namespace, name) → names of the tasks that depend on it.
    dependents: HashMap<Key, BTreeSet<String>>,
    /// parent (namespace, name) → names of the tasks it spawned.
    children: HashMap<Key, BTreeSet<String>>,
    /// (namespace, resource) → names of the unfinished tasks that need it.
    users: HashMap<Key, BTreeSet<String>>,
    /// Relist generation.
    generation: u64,
    /// Bumped whenever a cycle may have appeared: a task added, a
    /// `dependsOn` changed, a task back from a phase the cycle check leaves
    /// out. A task found on no cycle at this value need not be checked
    /// again until it changes.
    edges: u64,
    scratch: HashMap<Key, Scratch>,
    /// Wake-ups held during a relist (namespace, name).
    held: Option<BTreeSet<Key>>,
}

/// Phases the cycle check leaves out of the graph (see `deps::find_cycle`).
fn outside_cycles(p: Option<TaskPhase>) -> bool {
    matches!(
        p,
        Some(TaskPhase::Succeeded | TaskPhase::Ready | TaskPhase::Running)
    )
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
            parent: task
                .owner_references()
                .iter()
                .find(|o| o.controller == Some(true) && o.kind == "BatchTask")
                .map(|o| o.name.clone()),
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
                    && o.parent == new.parent
            });
            if !unchanged {
                if let Some(o) = &old {
                    inner.unlink(&ns, &name, o);
                }
                inner.link(&ns, &name, &new);
                wake.extend(inner.concerned(&ns, &name, old.as_ref(), &new));
                let may_close_a_cycle = old.as_ref().is_none_or(|o| {
                    o.depends_on != new.depends_on
                        || (outside_cycles(o.phase) && !outside_cycles(new.phase))
                });
                if may_close_a_cycle {
                    inner.edges += 1;
                }
                if old
                    .as_ref()
                    .is_some_and(|o| o.phase == Some(TaskPhase::Pending) && new.phase != o.phase)
                {
                    // A new wait is a new story: report its blocker again.
                    if let Some(sc) = inner.scratch.get_mut(&key) {
                        sc.blocker = None;
                        sc.lock_wait_since = None;
                    }
                }
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

    /// The graph generation (see `Inner::edges`).
    pub fn edges(&self) -> u64 {
        self.lock().edges
    }

    /// Whether the task was found on no cycle at generation `edges`.
    pub fn known_acyclic(&self, ns: &str, name: &str, edges: u64) -> bool {
        self.lock()
            .scratch
            .get(&(ns.to_owned(), name.to_owned()))
            .is_some_and(|s| s.no_cycle_at == Some(edges))
    }

    /// Remembers that the task is on no cycle at generation `edges`.
    pub fn mark_acyclic(&self, ns: &str, name: &str, edges: u64) {
        self.scratch(ns, name, |s| s.no_cycle_at = Some(edges));
    }

    /// When the task began taking its locks (set once per wait).
    pub fn lock_wait_started(&self, ns: &str, name: &str, now: Instant) {
        self.scratch(ns, name, |s| {
            s.lock_wait_since.get_or_insert(now);
        });
    }

    /// Ends the task's wait for locks; when it began.
    pub fn lock_wait_done(&self, ns: &str, name: &str) -> Option<Instant> {
        let mut inner = self.lock();
        let sc = inner.scratch.get_mut(&(ns.to_owned(), name.to_owned()))?;
        sc.blocker = None;
        sc.lock_wait_since.take()
    }

    /// The tasks waiting for their locks, and since when: `(namespace,
    /// name, since)`. For a gauge of the longest wait, which (unlike the
    /// histogram, observed when a wait ends) shows a wait that never ends.
    pub fn lock_waits(&self) -> Vec<(String, String, Instant)> {
        self.lock()
            .scratch
            .iter()
            .filter_map(|((ns, name), s)| Some((ns.clone(), name.clone(), s.lock_wait_since?)))
            .collect()
    }

    /// Records the task's blocker; true when it differs from the last one.
    pub fn new_blocker(&self, ns: &str, name: &str, blocker: &str) -> bool {
        let mut new = false;
        self.scratch(ns, name, |s| {
            new = s.blocker.as_deref() != Some(blocker);
            s.blocker = Some(blocker.to_owned());
        });
        new
    }

    /// Only for tasks the index knows: a deleted task's scratch is gone
    /// with it, and never comes back.
    fn scratch(&self, ns: &str, name: &str, f: impl FnOnce(&mut Scratch)) {
        let mut inner = self.lock();
        let key = (ns.to_owned(), name.to_owned());
        if inner.tasks.contains_key(&key) {
            f(inner.scratch.entry(key).or_default());
        }
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
        let mut inner = self.lock();
        inner.generation += 1;
        inner.held.get_or_insert_with(BTreeSet::new);
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
        let held = self.lock().held.take().unwrap_or_default();
        for (ns, name) in held {
            let _ = self.wake.unbounded_send(ObjectRef::new(&name).within(&ns));
        }
    }

    /// Names of the tasks in `namespace` that need `resource`.
    /// An unfinished task that still needs `name`: one that depends on it,
    /// or one it spawned (deleting it would delete that child with it).
    /// Its TTL waits for them.
    pub fn needed_by(&self, namespace: &str, name: &str) -> Option<String> {
        let inner = self.lock();
        let key = (namespace.to_owned(), name.to_owned());
        let unfinished = |n: &&String| {
            inner
                .tasks
                .get(&(namespace.to_owned(), (*n).clone()))
                .is_some_and(|e| !e.phase.is_some_and(TaskPhase::is_terminal))
        };
        [&inner.dependents, &inner.children]
            .into_iter()
            .filter_map(|m| m.get(&key))
            .flat_map(|set| set.iter())
            .find(unfinished)
            .cloned()
    }

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
        if names.is_empty() {
            return;
        }
        {
            let mut inner = self.lock();
            if let Some(held) = inner.held.as_mut() {
                held.extend(names.into_iter().map(|n| (namespace.to_owned(), n)));
                return;
            }
        }
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
        if let Some(parent) = &e.parent {
            self.children
                .entry((ns.to_owned(), parent.clone()))
                .or_default()
                .insert(name.to_owned());
        }
        for d in &e.depends_on {
            self.dependents
                .entry((ns.to_owned(), d.clone()))
                .or_default()
                .insert(name.to_owned());
        }
        // A finished task holds no lock and waits for none: leaving it out
        // keeps each resource's user list to the tasks that matter.
        if !e.phase.is_some_and(TaskPhase::is_terminal) {
            for r in &e.resources {
                self.users
                    .entry((ns.to_owned(), r.clone()))
                    .or_default()
                    .insert(name.to_owned());
            }
        }
    }

    fn unlink(&mut self, ns: &str, name: &str, e: &Entry) {
        let parent: Vec<String> = e.parent.iter().cloned().collect();
        for (map, keys) in [
            (&mut self.dependents, &e.depends_on),
            (&mut self.users, &e.resources),
            (&mut self.children, &parent),
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
        self.scratch.remove(&(ns.to_owned(), name.to_owned()));
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
    fn a_finished_task_is_needed_by_unfinished_dependents_and_children() {
        let (tx, _rx) = unbounded();
        let idx = GraphIndex::new(tx);
        idx.apply(&task("a", &[], &[], Some(TaskPhase::Succeeded)));
        assert_eq!(idx.needed_by("ns", "a"), None);
        idx.apply(&task("b", &["a"], &[], Some(TaskPhase::Pending)));
        assert_eq!(idx.needed_by("ns", "a").as_deref(), Some("b"));
        idx.apply(&task("b", &["a"], &[], Some(TaskPhase::Succeeded)));
        assert_eq!(idx.needed_by("ns", "a"), None);
        // A child a spawned (a is its controlling owner).
        let mut child = task("a-c1", &[], &[], Some(TaskPhase::Running));
        child.metadata.owner_references = Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                api_version: "batchlease.dev/v1alpha1".into(),
                kind: "BatchTask".into(),
                name: "a".into(),
                uid: "uid-a".into(),
                controller: Some(true),
                block_owner_deletion: Some(false),
            },
        ]);
        idx.apply(&child);
        assert_eq!(idx.needed_by("ns", "a").as_deref(), Some("a-c1"));
        idx.delete(&child);
        assert_eq!(idx.needed_by("ns", "a"), None);
    }

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
            BTreeSet::from(["big".to_string()]),
            "a finished task is no user any more"
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

    #[test]
    fn the_cycle_memo_is_invalidated_only_by_changes_that_may_close_a_cycle() {
        let (tx, _rx) = unbounded();
        let idx = GraphIndex::new(tx);
        idx.apply(&task("a", &["b"], &[], Some(TaskPhase::Pending)));
        let e = idx.edges();
        idx.mark_acyclic("ns", "a", e);
        assert!(idx.known_acyclic("ns", "a", idx.edges()));
        // Phase changes that cannot close a cycle keep it.
        idx.apply(&task("b", &[], &[], Some(TaskPhase::Running)));
        let e = idx.edges();
        idx.mark_acyclic("ns", "a", e);
        idx.apply(&task("b", &[], &[], Some(TaskPhase::Succeeded)));
        assert!(idx.known_acyclic("ns", "a", idx.edges()));
        // A new task, an edited dependsOn, or a task back from Running may.
        idx.apply(&task("c", &["a"], &[], None));
        assert!(!idx.known_acyclic("ns", "a", idx.edges()));
        let e = idx.edges();
        idx.mark_acyclic("ns", "a", e);
        idx.apply(&task("c", &["a", "b"], &[], None));
        assert!(!idx.known_acyclic("ns", "a", idx.edges()));
        idx.apply(&task("d", &[], &[], Some(TaskPhase::Running)));
        let e = idx.edges();
        idx.mark_acyclic("ns", "a", e);
        idx.apply(&task("d", &[], &[], Some(TaskPhase::Pending)));
        assert!(!idx.known_acyclic("ns", "a", idx.edges()));
        // Forgotten with the task.
        let e = idx.edges();
        idx.mark_acyclic("ns", "a", e);
        idx.delete(&task("a", &["b"], &[], Some(TaskPhase::Pending)));
        assert!(!idx.known_acyclic("ns", "a", idx.edges()));
        idx.mark_acyclic("ns", "a", e);
        assert!(
            !idx.known_acyclic("ns", "a", e),
            "no scratch for unknown tasks"
        );
    }

    #[test]
    fn wake_ups_wait_for_the_end_of_a_relist() {
        let (tx, mut rx) = unbounded();
        let idx = GraphIndex::new(tx);
        idx.apply(&task("b", &["a"], &[], Some(TaskPhase::Pending)));
        drain(&mut rx);
        idx.list_started();
        idx.apply(&task("b", &["a"], &[], Some(TaskPhase::Pending)));
        idx.apply(&task("a", &[], &[], Some(TaskPhase::Succeeded)));
        assert!(
            drain(&mut rx).is_empty(),
            "the store shows the list only at its end"
        );
        idx.list_done();
        assert_eq!(drain(&mut rx), vec!["b"]);
    }

    #[test]
    fn blockers_and_lock_waits_are_remembered_per_wait() {
        let (tx, _rx) = unbounded();
        let idx = GraphIndex::new(tx);
        let t0 = Instant::now();
        idx.apply(&task("a", &[], &["r"], Some(TaskPhase::Pending)));
        assert!(idx.new_blocker("ns", "a", "x"));
        assert!(!idx.new_blocker("ns", "a", "x"));
        assert!(idx.new_blocker("ns", "a", "y"));
        idx.lock_wait_started("ns", "a", t0);
        idx.lock_wait_started("ns", "a", t0 + std::time::Duration::from_secs(1));
        assert_eq!(
            idx.lock_wait_done("ns", "a"),
            Some(t0),
            "the first start counts"
        );
        assert_eq!(idx.lock_wait_done("ns", "a"), None);
        assert!(idx.lock_waits().is_empty());
        idx.lock_wait_started("ns", "a", t0);
        assert_eq!(idx.lock_waits(), vec![("ns".into(), "a".into(), t0)]);
        // Leaving Pending starts a new story.
        assert!(idx.new_blocker("ns", "a", "x"));
        idx.apply(&task("a", &[], &["r"], Some(TaskPhase::Ready)));
        assert!(idx.lock_waits().is_empty(), "a wait ends with Pending");
        idx.apply(&task("a", &[], &["r"], Some(TaskPhase::Pending)));
        assert!(idx.new_blocker("ns", "a", "x"));
    }
}
