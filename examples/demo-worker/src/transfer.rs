//! The speculative example (docs/speculative.md): move `amount` from one account to
//! another with `ctx.speculate`, no locks, commit with compare-and-swap.
//!
//! Payload: `{"transfer": {"from": "acct-1", "to": "acct-3", "amount": 7,
//! "thinkMillis": 50}}`. Accounts are keys of the SDK's `versioned_state`
//! table, state `{"balance": n}` (absent: 0). The round also sends a
//! "notice" — a row in `demo_outbox`, written outside the fenced
//! transaction like a mail or a message to another system — after
//! registering its compensation (the notice is cancelled: `cancelled + 1`).
//! So an audit can check that every notice of a round that did not commit
//! was cancelled exactly once, and none of a round that did. `thinkMillis`
//! widens the window between read and commit (the work a real handler
//! does), where other transfers can win the race.

use std::sync::Arc;
use std::time::Duration;

use batchlease_worker_sdk::postgres::FencedPool;
use batchlease_worker_sdk::speculate::Proposal;
use batchlease_worker_sdk::{Output, TaskContext, TaskError};
use serde::Deserialize;
use serde_json::json;

/// The outbox of notices, created by the demo.
pub const OUTBOX: &str = "CREATE TABLE IF NOT EXISTS demo_outbox (
    task_id   text NOT NULL,
    token     bigint NOT NULL,
    round     integer NOT NULL,
    account   text NOT NULL,
    amount    bigint NOT NULL,
    cancelled integer NOT NULL DEFAULT 0,
    PRIMARY KEY (task_id, token, round, account)
)";

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Transfer {
    from: String,
    to: String,
    amount: i64,
    #[serde(default)]
    think_millis: u64,
}

#[derive(Deserialize)]
struct Account {
    balance: i64,
}

fn balance(snap: &batchlease_worker_sdk::speculate::Snapshot, key: &str) -> Result<i64, TaskError> {
    Ok(snap.state::<Account>(key)?.map_or(0, |a| a.balance))
}

pub async fn run(
    ctx: &TaskContext,
    store: Arc<FencedPool>,
    t: &Transfer,
    identity: &str,
) -> Result<Output, TaskError> {
    if t.from == t.to {
        return Err(
            TaskError::permanent("a transfer needs two accounts").with_reason("InvalidTransfer")
        );
    }
    let uid = ctx.task_uid().to_owned();
    let identity = identity.to_owned();
    let done = ctx
        .speculate(store.clone(), &[&t.from, &t.to], |snap, undo| {
            let (store, t, uid, identity) =
                (store.clone(), t.clone(), uid.clone(), identity.clone());
            async move {
                let (from, to) = (balance(&snap, &t.from)?, balance(&snap, &t.to)?);
                // The notice goes out before the commit: register its undo
                // first, then send it.
                let (token, round) = (undo.token(), undo.round());
                {
                    let (store, uid, account, amount) =
                        (store.clone(), uid.clone(), t.from.clone(), t.amount);
                    // The undo may run before the notice arrives (the
                    // attempt was dropped while sending it): it leaves a
                    // cancelled row that absorbs the late notice.
                    undo.register("cancel-notice", move || async move {
                        let db = store.get().await.map_err(|e| e.to_string())?;
                        db.client()
                            .execute(
                                "INSERT INTO demo_outbox (task_id, token, round, account, amount, cancelled)
                                 VALUES ($1, $2, $3, $4, $5, 1)
                                 ON CONFLICT (task_id, token, round, account)
                                 DO UPDATE SET cancelled = demo_outbox.cancelled + 1",
                                &[&uid, &token, &round, &account, &amount],
                            )
                            .await
                            .map_err(|e| e.to_string())?;
                        Ok(())
                    })
                    .await?;
                }
                {
                    let db = store.get().await?;
                    db.client()
                        .execute(
                            "INSERT INTO demo_outbox (task_id, token, round, account, amount)
                             VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
                            &[&uid, &token, &round, &t.from, &t.amount],
                        )
                        .await
                        .map_err(|e| TaskError::retryable(format!("notice: {e}")))?;
                }
                tokio::time::sleep(Duration::from_millis(t.think_millis)).await;
                // The committed row names the worker, like the demo's
                // other commits (the e2e history checks it held the lease).
                let result = json!({"from": t.from, "to": t.to, "amount": t.amount, "worker": identity});
                Ok(Proposal::new(result)
                    .write(t.from.clone(), json!({"balance": from - t.amount}))
                    .write(t.to.clone(), json!({"balance": to + t.amount})))
            }
        })
        .await?;
    Ok(Output::json(json!({
        "transfer": done.result,
        "rounds": done.rounds,
        "earlier": done.earlier,
        "seen": ctx.task_name(),
    })))
}
