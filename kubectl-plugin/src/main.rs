//! `kubectl batchlease` (a kubectl plugin: kubectl runs `kubectl-batchlease`
//! from the PATH): looks at batchlease tasks and leases with the user's
//! kubeconfig, like kubectl.
//!
//!   kubectl batchlease status [-A]            per queue: phases, holders, oldest ready, abort rate
//!   kubectl batchlease tree TASK              dependencies, children, leases
//!   kubectl batchlease redrive TASK           a dead-lettered or rejected task back to Pending
//!   kubectl batchlease redrive --queue Q --all   every dead-lettered task of a queue
//!   kubectl batchlease cancel TASK...         spec.cancel=true (finished tasks left alone)
//!   kubectl batchlease cancel --queue Q --all    every unfinished task of a queue
//!   kubectl batchlease pause QUEUE            spec.paused=true on the queue's TaskQueue
//!   kubectl batchlease resume QUEUE           spec.paused=false
//!
//!   kubectl batchlease dashboard [-A] [--address 127.0.0.1:8470]
//!                                             a live web view (queues, tasks, timelines, locks)
//!
//! `-o json` everywhere; `-n`, `--context`, `--kubeconfig` as in kubectl.

mod age;
mod cancel;
mod dashboard;
#[cfg(test)]
mod fixtures;
mod pause;
mod redrive;
mod render;
mod status;
mod tree;
mod workers;
mod writes;

use anyhow::{Context, bail};
use batchlease_api::{BatchTask, TaskLease, TaskQueue, WorkerLease};
use clap::{Parser, Subcommand, ValueEnum};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

/// The field manager of the plugin's writes (`metadata.managedFields`).
const FIELD_MANAGER: &str = "kubectl-batchlease";

#[derive(Debug, Parser)]
#[command(
    name = "kubectl batchlease",
    version,
    about = "batchlease tasks and leases at a glance"
)]
struct Args {
    /// Namespace (default: the context's, else `default`).
    #[arg(short, long, global = true)]
    namespace: Option<String>,
    /// Every namespace (status only).
    #[arg(short = 'A', long, global = true)]
    all_namespaces: bool,
    /// Kubeconfig file (default: KUBECONFIG, then ~/.kube/config).
    #[arg(long, global = true)]
    kubeconfig: Option<std::path::PathBuf>,
    /// Kubeconfig context (default: the current one).
    #[arg(long, global = true)]
    context: Option<String>,
    /// Output format.
    #[arg(short, long, global = true, value_enum, default_value_t = Output::Text)]
    output: Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Per queue: tasks by phase, lease holders, the oldest ready task's
    /// wait, the speculative abort rate.
    Status,
    /// Per worker: renewed per lease or per worker, leases held, offers
    /// addressed to it, slots, its last renewal (WorkerLeases joined with
    /// TaskLeases).
    Workers,
    /// A task's dependencies, children and leases.
    Tree { task: String },
    /// Move dead-lettered tasks back to Pending with a fresh retry budget
    /// (raises spec.redrive).
    Redrive {
        /// The task (DeadLettered or Rejected).
        task: Option<String>,
        /// Every DeadLettered task of this queue (with --all).
        #[arg(long, requires = "all", conflicts_with = "task")]
        queue: Option<String>,
        /// Required with --queue: says that all of them are meant.
        #[arg(long)]
        all: bool,
    },
    /// Stop tasks for good (sets spec.cancel): the operator releases their
    /// leases and ends them Cancelled. Finished tasks are left alone.
    Cancel {
        /// The tasks (all must exist, or nothing is cancelled).
        tasks: Vec<String>,
        /// Every unfinished task of this queue (with --all).
        #[arg(long, requires = "all", conflicts_with = "tasks")]
        queue: Option<String>,
        /// Required with --queue: says that all of them are meant.
        #[arg(long)]
        all: bool,
    },
    /// Stop issuing leases for a queue (sets spec.paused on its TaskQueue,
    /// creating the TaskQueue if the queue has none).
    Pause { queue: String },
    /// Issue leases for a paused queue again (spec.paused=false).
    Resume { queue: String },
    /// Serve a live web view on this machine, with your credentials:
    /// queues, tasks, each task's graph and attempt timeline, resource
    /// locks and dead letters; cancel and redrive (confirmed, as you).
    Dashboard {
        /// Where to listen. Port 0 picks a free port (the URL printed
        /// says which). Keep it on loopback: the page acts as you.
        #[arg(long, default_value = "127.0.0.1:8470")]
        address: String,
        /// Also answer to this `Host` (name or name:port; repeatable): the
        /// name the dashboard is reached by when it listens elsewhere than
        /// loopback. Other names are refused (DNS rebinding).
        #[arg(long = "allow-host")]
        allow_host: Vec<String>,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let options = KubeConfigOptions {
        context: args.context.clone(),
        ..Default::default()
    };
    let config = match &args.kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path)
                .with_context(|| format!("reading {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &options).await?
        }
        None => kube::Config::from_kubeconfig(&options)
            .await
            .context("no kubeconfig (KUBECONFIG, ~/.kube/config)")?,
    };
    let namespace = args
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = kube::Client::try_from(config)?;
    let json = args.output == Output::Json;
    let place = in_namespace(&args, &namespace);
    let one_namespace = |what: &str| {
        if args.all_namespaces {
            bail!("{what} acts in one namespace: use -n");
        }
        Ok(())
    };
    let (tasks_api, leases_api, queues_api): (Api<BatchTask>, Api<TaskLease>, Api<TaskQueue>) =
        if args.all_namespaces {
            (
                Api::all(client.clone()),
                Api::all(client.clone()),
                Api::all(client.clone()),
            )
        } else {
            (
                Api::namespaced(client.clone(), &namespace),
                Api::namespaced(client.clone(), &namespace),
                Api::namespaced(client.clone(), &namespace),
            )
        };
    let list = ListParams::default();
    let list_tasks = || async {
        anyhow::Ok(
            tasks_api
                .list(&list)
                .await
                .context("listing batchtasks")?
                .items,
        )
    };
    let list_leases = || async {
        anyhow::Ok(
            leases_api
                .list(&list)
                .await
                .context("listing taskleases")?
                .items,
        )
    };
    let now = Timestamp::now();
    match args.command {
        Command::Status => {
            let tasks = list_tasks().await?;
            let leases = list_leases().await?;
            let controls = match queues_api.list(&list).await {
                Ok(l) => l.items,
                // An older install without the TaskQueue kind, or no
                // permission to list them: every queue shows unpaused.
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 403 => {
                    eprintln!(
                        "warning: cannot list taskqueues ({}): PAUSED shows false",
                        s.message
                    );
                    vec![]
                }
                Err(e) => return Err(anyhow::Error::new(e).context("listing taskqueues")),
            };
            let queues = status::summarize(&tasks, &leases, &controls, now);
            if json {
                println!("{}", serde_json::to_string_pretty(&queues)?);
            } else if queues.is_empty() {
                println!("No BatchTasks found{place}.");
            } else {
                print!("{}", status::table(&queues, args.all_namespaces));
            }
        }
        Command::Workers => {
            let leases = list_leases().await?;
            let wl_api: Api<WorkerLease> = if args.all_namespaces {
                Api::all(client.clone())
            } else {
                Api::namespaced(client.clone(), &namespace)
            };
            let worker_leases = match wl_api.list(&list).await {
                Ok(l) => l.items,
                // An older install without the WorkerLease kind, or no
                // permission to list them: holders of leases only.
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 403 => {
                    eprintln!(
                        "warning: cannot list workerleases ({}): workers renewing per worker show only what they hold",
                        s.message
                    );
                    vec![]
                }
                Err(e) => return Err(anyhow::Error::new(e).context("listing workerleases")),
            };
            let rows = workers::summarize(&worker_leases, &leases, now);
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else if rows.is_empty() {
                println!("No workers found{place}.");
            } else {
                print!("{}", workers::table(&rows, args.all_namespaces));
            }
        }
        Command::Tree { task } => {
            if args.all_namespaces {
                bail!("tree looks at one namespace: use -n");
            }
            let tasks = list_tasks().await?;
            let leases = list_leases().await?;
            let Some(t) = tree::tree(&task, &tasks, &leases, now) else {
                bail!("task {task} not found{place}");
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&t)?);
            } else {
                print!("{}", tree::render(&t));
            }
        }
        Command::Redrive { task, queue, all } => {
            one_namespace("redrive")?;
            let selection = match (task, queue) {
                (Some(t), None) => redrive::Selection::Task(t),
                (None, Some(q)) if all => redrive::Selection::Queue(q),
                _ => bail!("redrive TASK, or redrive --queue QUEUE --all"),
            };
            let tasks = list_tasks().await?;
            let targets = redrive::targets(&tasks, &selection).map_err(anyhow::Error::msg)?;
            let mut done = Vec::new();
            let mut failed = Vec::new();
            for t in targets {
                let name = &t.name;
                match writes::redrive(&tasks_api, name, &t.uid, t.redrive).await {
                    Ok(_) => {
                        done.push(serde_json::json!({"task": name, "redrive": t.redrive}));
                        if !json {
                            println!("batchtask/{name} redriven (spec.redrive={})", t.redrive);
                        }
                    }
                    // Gone since the list (its TTL, say): nothing to redrive.
                    Err(kube::Error::Api(s)) if s.code == 404 => {
                        eprintln!("batchtask/{name} is gone: skipped");
                    }
                    Err(e) => failed.push(format!("{name}: {}", describe(&e))),
                }
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&done)?);
            } else if done.is_empty() && failed.is_empty() {
                println!("No DeadLettered tasks to redrive{place}.");
            }
            if !failed.is_empty() {
                bail!("not redriven: {}", failed.join("; "));
            }
        }
        Command::Cancel { tasks, queue, all } => {
            one_namespace("cancel")?;
            let selection = match (tasks.is_empty(), queue) {
                (false, None) => cancel::Selection::Tasks(tasks),
                (true, Some(q)) if all => cancel::Selection::Queue(q),
                _ => bail!("cancel TASK..., or cancel --queue QUEUE --all"),
            };
            let listed = list_tasks().await?;
            let decisions = cancel::decisions(&listed, &selection)
                .map_err(|e| anyhow::anyhow!("{e}{place}: nothing cancelled"))?;
            let mut done = Vec::new();
            let mut failed = Vec::new();
            for d in decisions {
                let name = &d.name;
                if d.needs_patch() {
                    match writes::cancel(&tasks_api, name, &d.uid).await {
                        Ok(_) => {}
                        // Gone since the list: nothing left to cancel.
                        Err(kube::Error::Api(s)) if s.code == 404 => {
                            eprintln!("batchtask/{name} is gone: skipped");
                            continue;
                        }
                        Err(e) => {
                            failed.push(format!("{name}: {}", describe(&e)));
                            continue;
                        }
                    }
                }
                if !json {
                    println!("{}", d.message());
                }
                done.push(d);
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&done)?);
            } else if done.is_empty() && failed.is_empty() {
                println!("No unfinished tasks to cancel{place}.");
            }
            if !failed.is_empty() {
                bail!("not cancelled: {}", failed.join("; "));
            }
        }
        Command::Pause { queue } => {
            one_namespace("pause")?;
            pause::check_queue(&queue).map_err(anyhow::Error::msg)?;
            let outcome = set_paused(&queues_api, &namespace, &queue, true).await?;
            report(&outcome, json)?;
        }
        Command::Dashboard {
            address,
            allow_host,
        } => {
            let scope = dashboard::Scope {
                namespace: (!args.all_namespaces).then(|| namespace.clone()),
            };
            dashboard::serve(client, scope, &address, &allow_host).await?;
        }
        Command::Resume { queue } => {
            one_namespace("resume")?;
            pause::check_queue(&queue).map_err(anyhow::Error::msg)?;
            let outcome = set_paused(&queues_api, &namespace, &queue, false).await?;
            report(&outcome, json)?;
        }
    }
    Ok(())
}

/// An API error as the server worded it (the status's message), other
/// errors with their causes.
fn describe(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => s.message.clone(),
        e => batchlease_api::Chain(e).to_string(),
    }
}

fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..Default::default()
    }
}

/// Sets `spec.paused` of TaskQueue `queue` (creating it to pause). Another
/// writer creating, deleting or re-creating it meanwhile makes the write
/// fail (create: AlreadyExists; patch: not found, or the UID changed), and
/// it is read and decided again.
async fn set_paused(
    api: &Api<TaskQueue>,
    namespace: &str,
    queue: &str,
    paused: bool,
) -> anyhow::Result<pause::Outcome> {
    let what = || format!("taskqueue/{queue} in namespace {namespace}");
    let mut attempts = 0;
    loop {
        attempts += 1;
        let existing = api
            .get_opt(queue)
            .await
            .with_context(|| format!("reading {}", what()))?;
        let plan = pause::plan(queue, existing.as_ref(), paused);
        let written = match &plan {
            pause::Plan::Nothing => Ok(()),
            pause::Plan::Create(body) => {
                let tq: TaskQueue = serde_json::from_value(body.clone())?;
                let pp = PostParams {
                    field_manager: Some(FIELD_MANAGER.into()),
                    ..Default::default()
                };
                api.create(&pp, &tq).await.map(drop)
            }
            pause::Plan::Patch(patch) => api
                .patch(queue, &patch_params(), &Patch::Merge(patch))
                .await
                .map(drop),
        };
        match written {
            Ok(()) => {
                return Ok(pause::Outcome::of(
                    queue,
                    namespace,
                    &plan,
                    existing.is_some(),
                    paused,
                ));
            }
            Err(kube::Error::Api(s)) if matches!(s.code, 404 | 409) && attempts < 3 => {}
            Err(e) => bail!("writing {}: {}", what(), describe(&e)),
        }
    }
}

fn report(outcome: &pause::Outcome, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(outcome)?);
    } else {
        println!("{}", outcome.message());
    }
    Ok(())
}

fn in_namespace(args: &Args, namespace: &str) -> String {
    if args.all_namespaces {
        String::new()
    } else {
        format!(" in namespace {namespace}")
    }
}
