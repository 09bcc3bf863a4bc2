//! `kubectl batchlease` (a kubectl plugin: kubectl runs `kubectl-batchlease`
//! from the PATH): looks at batchlease tasks and leases with the user's
//! kubeconfig, like kubectl.
//!
//!   kubectl batchlease status [-A]            per queue: phases, holders, oldest ready, abort rate
//!   kubectl batchlease tree TASK              dependencies, children, leases
//!   kubectl batchlease redrive TASK           a dead-lettered or rejected task back to Pending
//!   kubectl batchlease redrive --queue Q --all   every dead-lettered task of a queue
//!
//! `-o json` everywhere; `-n`, `--context`, `--kubeconfig` as in kubectl.

mod age;
#[cfg(test)]
mod fixtures;
mod redrive;
mod render;
mod status;
mod tree;

use anyhow::{Context, bail};
use batchlease_api::{BatchTask, TaskLease};
use clap::{Parser, Subcommand, ValueEnum};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};

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
    let (tasks_api, leases_api): (Api<BatchTask>, Api<TaskLease>) = if args.all_namespaces {
        (Api::all(client.clone()), Api::all(client.clone()))
    } else {
        (
            Api::namespaced(client.clone(), &namespace),
            Api::namespaced(client.clone(), &namespace),
        )
    };
    let list = ListParams::default();
    let tasks = tasks_api
        .list(&list)
        .await
        .context("listing batchtasks")?
        .items;
    let now = Timestamp::now();
    let json = args.output == Output::Json;
    let place = in_namespace(&args, &namespace);
    match args.command {
        Command::Status => {
            let leases = leases_api
                .list(&list)
                .await
                .context("listing taskleases")?
                .items;
            let queues = status::summarize(&tasks, &leases, now);
            if json {
                println!("{}", serde_json::to_string_pretty(&queues)?);
            } else if queues.is_empty() {
                println!("No BatchTasks found{place}.");
            } else {
                print!("{}", status::table(&queues, args.all_namespaces));
            }
        }
        Command::Tree { task } => {
            if args.all_namespaces {
                bail!("tree looks at one namespace: use -n");
            }
            let leases = leases_api
                .list(&list)
                .await
                .context("listing taskleases")?
                .items;
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
            if args.all_namespaces {
                bail!("redrive acts in one namespace: use -n");
            }
            let selection = match (task, queue) {
                (Some(t), None) => redrive::Selection::Task(t),
                (None, Some(q)) if all => redrive::Selection::Queue(q),
                _ => bail!("redrive TASK, or redrive --queue QUEUE --all"),
            };
            let targets = redrive::targets(&tasks, &selection).map_err(anyhow::Error::msg)?;
            let mut done = Vec::new();
            let mut failed = Vec::new();
            for t in targets {
                // The UID makes the patch conditional: a task deleted and
                // created again under this name meanwhile is not touched.
                let patch = serde_json::json!({
                    "metadata": {"uid": t.uid},
                    "spec": {"redrive": t.redrive},
                });
                let name = &t.name;
                match tasks_api
                    .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
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
                    Err(e) => failed.push(format!("{name}: {}", batchlease_api::Chain(&e))),
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
