//! The model's transitions: which steps each actor may take in a state
//! ([`Cluster::steps`]) and what each does ([`Cluster::apply`]), for the
//! [`stateright::Model`] impl in `lib.rs`.

use super::*;

impl Cluster {
    /// `s`, or with [`Config::start_pending`] the state after the
    /// operator's first pass of every task landed and its cache caught up.
    pub(crate) fn started(&self, mut s: State) -> State {
        if self.cfg.start_pending {
            for i in 0..s.api.tasks.len() {
                s.op.tasks = Some(s.api.task_view());
                self.reconcile(&mut s, i);
                self.send_pending(&mut s, i);
            }
            if self.cfg.start_quarantined {
                speculate::quarantine_last(&mut s);
            }
            s.op.tasks = Some(s.api.task_view());
        }
        s
    }

    /// No step but a tick changes anything.
    pub(crate) fn quiescent(&self, s: &State) -> bool {
        let mut steps = Vec::new();
        self.steps(s, &mut steps);
        steps.into_iter().all(|a| self.apply(s, a).is_none())
    }

    /// Every step but a tick that `s` allows.
    pub(crate) fn steps(&self, s: &State, actions: &mut Vec<Action>) {
        if s.op.tasks.as_ref() != Some(&s.api.task_view()) {
            actions.push(Action::SyncTask);
        }
        if s.op.leases != s.api.leases {
            actions.push(Action::SyncLeases);
        }
        if self.cfg.per_worker {
            if s.op.wleases != s.api.workers {
                actions.push(Action::SyncWorkerLeases);
            }
            self.fleet_faults(s, actions);
        }
        if self.cfg.addressed {
            self.offer_steps(s, actions);
        }
        if s.op.tasks.is_some() {
            for i in 0..s.api.tasks.len() {
                if !s.op.pending.contains_key(&i) {
                    actions.push(Action::Reconcile(i));
                }
            }
        }
        for (i, w) in &s.op.pending {
            // A new offer's create: addressed first (effects/mod.rs), to
            // each worker `offers::choose` may pick.
            let to = match w {
                Write::Create(l) => self.addressees(s, l),
                _ => Vec::new(),
            };
            if to.is_empty() {
                actions.push(Action::SendWrite(*i));
            }
            actions.extend(to.into_iter().map(|w| Action::SendAddressed(*i, w)));
        }
        if s.crashes < self.cfg.operator_crashes && s.op != Operator::default() {
            actions.push(Action::CrashOperator);
        }
        for i in 0..s.late.len() {
            actions.push(Action::LateWrite(i));
        }
        for k in 0..s.spawn.in_flight.len() {
            actions.push(Action::SpawnLands(k));
        }
        // With a TTL edit the cancel (which cuts the TTL) comes after a
        // lease was deleted: the other orders are the cancel bounds'.
        if self.cfg.cancel && !s.api.task(0).spec.cancel && (!self.cfg.ttl_edit || s.deletions > 0)
        {
            actions.push(Action::Cancel(0));
        }
        if self.cfg.task_deletion && s.api.deleted.is_empty() {
            actions.push(Action::DeleteTask(0));
        }
        for name in s.api.collectable() {
            actions.push(Action::CollectLease(name));
        }
        if s.deletions < self.cfg.lease_deletions {
            for (name, l) in &s.api.leases {
                let l: TaskLease = decode(l);
                if phase(&l) == Some(LeasePhase::Held) {
                    actions.push(Action::DeleteLease(name.clone()));
                }
            }
        }
        for (w, worker) in s.workers.iter().enumerate() {
            if !self.acts(w) {
                continue;
            }
            self.bound_steps(s, w, actions);
            match worker {
                Worker::Idle => {
                    if self.cfg.bound {
                        self.fleet_steps(s, w, actions);
                    }
                    for (name, l) in &s.api.leases {
                        let l: TaskLease = decode(l);
                        if phase(&l) == Some(LeasePhase::Offered)
                            && self.serves(w, &l)
                            && self.may_claim(w, &l)
                        {
                            actions.push(Action::Claim(w, name.clone()));
                            if s.lost < self.cfg.lost_answers {
                                actions.push(Action::ClaimAnswerLost(w, name.clone()));
                            }
                        }
                    }
                }
                Worker::Holding(a) => {
                    if self.cfg.per_worker {
                        self.fleet_steps(s, w, actions);
                    } else if self.alive(a, s.now) && a.last_ok_sent < s.now {
                        actions.push(Action::Renew(w));
                        if s.lost < self.cfg.lost_answers {
                            actions.push(Action::RenewAnswerLost(w));
                        }
                    }
                    let registered = a.registered || self.cfg.storage == StorageRule::CommitOnly;
                    if !a.registered
                        && !a.not_started
                        && self.cfg.storage == StorageRule::RegisterFirst
                    {
                        actions.push(Action::Register(w));
                    }
                    let lost = a.round.as_ref().is_some_and(|r| r.lost);
                    if registered && !a.checked && !lost {
                        actions.push(if a.round.is_some() {
                            Action::ReadKey(w)
                        } else {
                            Action::CheckFence(w)
                        });
                    }
                    if a.checked && !a.committed {
                        actions.push(Action::CommitLands(w));
                    }
                    // One create per run: every attempt spawns the same
                    // child, so a second create only meets AlreadyExists.
                    if self.cfg.spawn
                        && a.task == 0
                        && !a.spawned
                        && s.spawn.in_flight.is_empty()
                        && s.api.tasks.len() == spawn::child_index(self)
                    {
                        actions.push(Action::SpawnCheck(w));
                    }
                    // The handler returns only once its creates answered.
                    if (a.committed || lost || a.not_started) && !Self::spawning(s, w, &a.lease) {
                        actions.push(Action::Complete(w));
                    }
                }
            }
        }
    }

    pub(crate) fn apply(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match &action {
            Action::Tick => {
                s.now += 1;
                self.forget_sends(&mut s);
            }
            Action::SyncTask => {
                s.op.tasks = Some(s.api.task_view());
                s.op.refused.clear();
            }
            Action::SyncLeases => {
                let now = self.instant(s.now);
                // Leases gone since the last sync: the watch's Delete
                // event carries each one's last state (`Tracker::forget`).
                // (Only with task deletion: the timing matters only for a
                // deleted task's lock, and would split the other bounds'
                // states.)
                let gone: Vec<String> = if self.cfg.task_deletion {
                    s.op.leases
                        .keys()
                        .filter(|n| !s.api.leases.contains_key(*n))
                        .cloned()
                        .collect()
                } else {
                    Vec::new()
                };
                for name in gone {
                    let (last, final_state) = match s.api.deleted_leases.get(&name) {
                        Some(l) => (decode::<TaskLease>(l), true),
                        None => (decode::<TaskLease>(&s.op.leases[&name]), false),
                    };
                    let until = holder_stops_by(s.op.seen.get(&name), &last, final_state, now)
                        .unwrap_or(now);
                    s.op.departed
                        .insert(name, (last.spec.task_uid.clone(), until));
                }
                let mut seen = BTreeMap::new();
                for (name, json) in &s.api.leases {
                    let l: TaskLease = decode(json);
                    if let Some(next) = next_seen(s.op.seen.get(name), &l, now) {
                        seen.insert(name.clone(), next);
                    }
                }
                s.op.seen = seen;
                self.book_sync(&mut s);
                s.op.leases = s.api.leases.clone();
                s.op.refused.clear();
            }
            Action::Reconcile(i) => {
                self.reconcile(&mut s, *i);
            }
            Action::SendWrite(i) => self.send_pending(&mut s, *i),
            Action::SendAddressed(i, w) => {
                self.address_new(&mut s, *i, *w);
                self.send_pending(&mut s, *i);
            }
            Action::CrashOperator => {
                s.crashes += 1;
                // Already sent: they may still land.
                let pending = std::mem::take(&mut s.op.pending);
                s.late.extend(pending.into_values().map(Write::in_flight));
                s.op = Operator::default();
            }
            Action::LateWrite(i) => {
                let w = s.late.remove(*i);
                // The book of the operator that sent it is gone; the one
                // running now learns of the write from its lease cache.
                let book = s.op.book.clone();
                if self.send(&mut s, w).applied {
                    s.late_landed = true;
                }
                s.op.book = book;
            }
            Action::Cancel(i) => {
                let cut = self.cfg.ttl_edit;
                s.api.edit_spec(*i, |spec| {
                    spec.cancel = true;
                    if cut {
                        spec.lease_duration_seconds = TTL_SECONDS;
                    }
                });
                cancel::requested(&mut s, *i);
            }
            Action::DeleteTask(i) => {
                locks::task_deleted(&mut s, *i);
                s.api.delete_task(*i);
            }
            Action::CollectLease(name) => s.api.collect_lease(name),
            Action::DeleteLease(name) => {
                s.deletions += 1;
                let _ = s.api.delete_lease(name, None);
            }
            Action::SyncWorkerLeases => self.fleet_sync(&mut s),
            Action::Renew(w) if self.cfg.per_worker => {
                self.fleet_renew(&mut s, *w, fleet::Send::Normal);
            }
            Action::RenewAnswerLost(w) if self.cfg.per_worker => {
                self.fleet_renew(&mut s, *w, fleet::Send::AnswerLost);
            }
            Action::SendRenewal(w) => self.fleet_renew(&mut s, *w, fleet::Send::Late),
            Action::DropAttempt(w) => self.fleet_renew(&mut s, *w, fleet::Send::Drop),
            Action::RenewLands(w) => self.fleet_lands(&mut s, *w),
            Action::DeleteWorkerLease(name) => {
                s.fleet.deletions += 1;
                s.api.delete_worker_lease(name);
            }
            Action::ClaimAnswerLost(w, name) => {
                s.lost += 1;
                s.lost_claim = true;
                self.claim(&mut s, *w, name)?;
            }
            Action::RenewAnswerLost(w) => {
                let Worker::Holding(a) = &s.workers[*w] else {
                    return None;
                };
                let mut l: TaskLease = decode(&a.copy);
                l.spec.renew_time = Some(MicroTime(self.wall(s.now, s.api.lease_writes(&a.lease))));
                s.lost += 1;
                s.lost_renewal = true;
                s.api.replace_lease(&l).ok()?;
            }
            Action::Lapse(w) => Self::lapse(&mut s, *w),
            Action::SeeBound(w, name) => self.see_bound(&mut s, *w, name),
            Action::LookBound(w, name) => self.look_bound(&mut s, *w, name),
            Action::Claim(w, name) => {
                // A refused claim is no step (a ghost may record it).
                let Some(stored) = self.claim(&mut s, *w, name) else {
                    return (s != *last).then_some(s);
                };
                let task = s.api.task_index(&stored.spec.task_name)?;
                // The SDK runs the attempt in the task's effectiveMode, as
                // read for the claim.
                let mode = s.api.task(task).status.and_then(|st| st.effective_mode);
                s.workers[*w] = Worker::Holding(Attempt {
                    rate: s.rates[*w],
                    task,
                    resource_tokens: stored.spec.resource_tokens.clone(),
                    lease: name.clone(),
                    token: stored.spec.fencing_token,
                    ttl: stored.spec.lease_duration_seconds,
                    copy: encode(&stored),
                    claim_sent: s.now,
                    last_ok_sent: s.now,
                    last_refresh_sent: s.now,
                    registered: false,
                    not_started: false,
                    checked: false,
                    committed: false,
                    spawned: false,
                    round: self.cfg.speculative.then(|| Round {
                        exclusive: mode == Some(TaskMode::Exclusive),
                        ..Round::default()
                    }),
                    dropped: false,
                });
            }
            Action::SpawnLands(k) => self.spawn_lands(&mut s, *k),
            Action::Renew(w)
            | Action::SpawnCheck(w)
            | Action::Register(w)
            | Action::CheckFence(w)
            | Action::ReadKey(w)
            | Action::CommitLands(w)
            | Action::Complete(w)
            | Action::Refresh(w) => self.worker_step(&mut s, *w, &action),
        }
        // A step that changes nothing is no step: paths then end where
        // nothing can happen any more, which `eventually` needs.
        (s != *last).then_some(s)
    }
}
