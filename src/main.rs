//! The `idemgate` binary: parses the command line and calls into the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use idemgate::commands::{self, CommandError};
use idemgate::config::{Config, LogFormat};

#[derive(Parser)]
#[command(
    name = "idemgate",
    version,
    about = "An idempotency gateway: makes retries of non-idempotent HTTP calls safe"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Validate a config file and print the resolved routes (exit 0 or 64).
    Check {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Apply database migrations and exit.
    Migrate {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Zero-setup run of the lab: a naive ledger, straight and through idemgate.
    #[cfg(feature = "demo")]
    Demo {
        /// Run on PostgreSQL (postgres://...) instead of the embedded store.
        #[arg(long)]
        store: Option<String>,
        /// Leave the gateway running afterwards and print commands to try by hand.
        #[arg(long)]
        keep_running: bool,
    },
    /// Serve the lab's naive legacy ledger alone (the demo's upstream; for docker-compose).
    #[cfg(feature = "demo")]
    LabLedger {
        #[arg(long, default_value = "127.0.0.1:9000")]
        listen: std::net::SocketAddr,
    },
    /// Delete expired rows once (one instance at a time; a no-op while another collects).
    Gc {
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Exit 0 when the admin listener's /readyz answers 200, else 1 with the reason on
    /// stderr: a container HEALTHCHECK without curl in the image.
    #[command(group(clap::ArgGroup::new("target").required(true).args(["config", "url"])))]
    Health {
        /// Ask /readyz on this config's admin.listen (0.0.0.0 and :: mean the loopback).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// Ask this URL instead (http:// only), e.g. http://127.0.0.1:9090/readyz.
        #[arg(long)]
        url: Option<String>,
        /// Give up after this long, connecting included (250ms, 2s, ...).
        #[arg(long, default_value = "2s", value_parser = idemgate::config::parse_duration)]
        timeout: std::time::Duration,
    },
    /// Inspect or release stored keys.
    Keys {
        #[command(subcommand)]
        command: KeysCommand,
    },
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Show one key's row (with the key id that the logs name it by).
    Show {
        #[arg(long, short)]
        config: PathBuf,
        /// The scope value the client sent (or a stored scope as `keys show` prints it).
        #[arg(long)]
        scope: String,
        #[arg(long)]
        key: String,
        /// The route, when routes with different scope sources share the value.
        #[arg(long)]
        route: Option<String>,
    },
    /// List stored keys, a page at a time, in (scope, key) order: the keys that need a
    /// decision (`--state unknown`), or any others. With the embedded store while `serve`
    /// runs, ask its admin API instead (`GET /v1/keys` on admin.listen).
    List {
        #[arg(long, short)]
        config: PathBuf,
        /// Only keys in this state: in_flight, completed, not_replayable or unknown.
        #[arg(long)]
        state: Option<String>,
        /// Only keys of this route.
        #[arg(long)]
        route: Option<String>,
        /// Only keys of this scope value (as for `keys show`).
        #[arg(long)]
        scope: Option<String>,
        /// Only keys created at least this long ago (10m, 1h, ...).
        #[arg(long)]
        older_than: Option<String>,
        /// The most keys on this page (1 to 1000, default 50).
        #[arg(long)]
        limit: Option<String>,
        /// Where to go on from: the cursor the previous page printed.
        #[arg(long)]
        cursor: Option<String>,
        /// Print one JSON object ({"keys": [...], "next_cursor": ...}) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Delete one key's row (releases a held or stuck key). A key in flight under a live
    /// lease is refused (exit 1) unless --force.
    Delete {
        #[arg(long, short)]
        config: PathBuf,
        #[arg(long)]
        scope: String,
        #[arg(long)]
        key: String,
        #[arg(long)]
        route: Option<String>,
        /// Delete even a key in flight under a live lease (a possible double).
        #[arg(long)]
        force: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `serve` logs as its config says; a bad config exits 64 before any port is bound.
    let serve_config = match &cli.command {
        Command::Serve { config } => match Config::load(config) {
            Ok(c) => Some(c),
            Err(e) => {
                eprintln!("idemgate: {e}");
                return ExitCode::from(64);
            }
        },
        _ => None,
    };
    idemgate::logging::init(
        serve_config
            .as_ref()
            .map_or(LogFormat::Text, |c| c.log_format),
    );
    // Thread per core: this thread's runtime is the first serving thread (and runs the
    // admin plane and the background tasks); `App::run` starts the others.
    let runtime = match idemgate::server::runtime(serve_config.as_ref().map(|c| &c.server)) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idemgate: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result: Result<(), CommandError> = runtime.block_on(async {
        match cli.command {
            Command::Serve { config } => {
                commands::serve(&config, serve_config.expect("loaded above")).await
            }
            Command::Check { config } => {
                print!("{}", commands::check(&config)?);
                Ok(())
            }
            Command::Migrate { config } => {
                let (n, online) = commands::migrate(&config).await?;
                println!("applied {n} migration(s)");
                if online.indexes_built > 0 || online.rows_filled > 0 {
                    println!(
                        "built {} index(es) concurrently; backfilled {} row(s)",
                        online.indexes_built, online.rows_filled
                    );
                }
                Ok(())
            }
            #[cfg(feature = "demo")]
            Command::Demo {
                store,
                keep_running,
            } => {
                let passed = idemgate::demo::run(idemgate::demo::DemoOptions {
                    store,
                    keep_running,
                })
                .await
                .map_err(CommandError::Other)?;
                if passed {
                    Ok(())
                } else {
                    Err(CommandError::Other(
                        "some checks failed through idemgate".into(),
                    ))
                }
            }
            #[cfg(feature = "demo")]
            Command::LabLedger { listen } => {
                let ledger = idemgate::lab::Ledger::new(std::time::Duration::from_millis(10));
                let listener = tokio::net::TcpListener::bind(listen).await?;
                eprintln!(
                    "idemgate: the naive legacy ledger listens on {listen} (POST {})",
                    idemgate::lab::WEBHOOK_PATH
                );
                let task = ledger.serve(listener);
                let _ = tokio::signal::ctrl_c().await;
                task.abort();
                Ok(())
            }
            Command::Gc { config } => {
                let run = commands::gc(&config).await?;
                if run.ran {
                    println!("deleted {} expired key(s)", run.deleted);
                } else {
                    println!("another instance is collecting expired keys; nothing done");
                }
                Ok(())
            }
            Command::Health {
                config,
                url,
                timeout,
            } => {
                let target = match (config, url) {
                    (Some(path), _) => commands::HealthTarget::Config(path),
                    (None, Some(url)) => commands::HealthTarget::Url(url),
                    (None, None) => unreachable!("clap requires --config or --url"),
                };
                // Exit 1 for every failure, a bad config included: see commands::health.
                let line = commands::health(&target, timeout)
                    .await
                    .map_err(|why| CommandError::Other(format!("unhealthy: {why}")))?;
                println!("{line}");
                Ok(())
            }
            Command::Keys { command } => match command {
                KeysCommand::Show {
                    config,
                    scope,
                    key,
                    route,
                } => {
                    let shown = commands::keys_show(&config, &scope, &key, route.as_deref());
                    println!("{}", shown.await?);
                    Ok(())
                }
                KeysCommand::List {
                    config,
                    state,
                    route,
                    scope,
                    older_than,
                    limit,
                    cursor,
                    json,
                } => {
                    let args = commands::ListArgs {
                        state,
                        route,
                        scope,
                        older_than,
                        limit,
                        cursor,
                    };
                    let listed = commands::keys_list(&config, args, json).await?;
                    print!("{listed}");
                    if json {
                        println!();
                    }
                    Ok(())
                }
                KeysCommand::Delete {
                    config,
                    scope,
                    key,
                    route,
                    force,
                } => {
                    commands::keys_delete(&config, &scope, &key, route.as_deref(), force).await?;
                    println!("deleted key '{key}' in scope '{scope}'");
                    Ok(())
                }
            },
        }
    });
    idemgate::logging::flush();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idemgate: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
