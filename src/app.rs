//! The one wiring path from a configuration to a serving gateway. `idemgate serve` and the
//! integration tests both go through [`App::build`] and [`App::run`], so what the tests
//! exercise is what a user runs: the store checked and migrated first (and retried in the
//! background when it does not answer yet), the wake-up listener, the admin plane, the
//! periodic garbage collection, SIGHUP reloads, the drain and graceful shutdown.
//!
//! Invariants:
//! - [`App::build`] binds nothing: the caller hands over [`Listeners`] it bound (`serve` the
//!   configured addresses, a test `127.0.0.1:0`), so nobody picks a port and hopes.
//! - A database that may lose commits (contract §8.4) is a configuration error, not an outage:
//!   `build` refuses it when it answers at once, and `run` stops with the same error when it
//!   is found so later. A store that does not answer is an outage: the gateway serves (keyed
//!   requests get 503 `store-unavailable`, `/readyz` says not ready) and keeps trying.
//! - Everything `run` spawns stops with it: the admin plane, the GC loop and the retries of
//!   the store's preparation watch the same stop signal.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};

use crate::config::{Config, GcConfig, RuntimeLayout, StoreConfig};
use crate::gateway::Gateway;
use crate::store::postgres::PgStore;
use crate::store::{Store, StoreError};

/// Why a gateway could not be built or stopped serving with an error.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The listener could not serve (its TLS files cannot be loaded).
    #[error("{0}")]
    Serve(String),
    #[error("this build has no embedded store")]
    NoEmbeddedStore,
    /// Traces are asked for but cannot be set up (a bad `OTEL_*` variable, an exporter that
    /// cannot start).
    #[error("{0}")]
    Telemetry(String),
}

/// The sockets a gateway serves on, bound by the caller.
pub struct Listeners {
    /// Proxied traffic (`listen`).
    pub main: TcpListener,
    /// The admin plane (`admin.listen`): health, readiness, metrics, the key API.
    pub admin: Option<TcpListener>,
}

impl Listeners {
    /// Binds the addresses the configuration names.
    pub async fn bind(config: &Config) -> std::io::Result<Listeners> {
        let main = TcpListener::bind(config.listen).await?;
        let admin = match &config.admin {
            Some(a) => Some(TcpListener::bind(a.listen).await?),
            None => None,
        };
        Ok(Listeners { main, admin })
    }
}

/// A gateway wired up and ready to serve: store opened (and prepared when it answered),
/// listeners bound, nothing accepted yet.
pub struct App {
    config: Arc<Config>,
    store: Arc<dyn Store>,
    postgres: Option<Arc<PgStore>>,
    gateway: Arc<Gateway>,
    listeners: Listeners,
    prepared: bool,
    reload_from: Option<PathBuf>,
}

impl App {
    /// Opens the store, checks that it keeps its commits and applies the migrations (when it
    /// answers), starts its wake-up listener, and builds the gateway. Fails on a store that
    /// cannot be opened at all (a bad embedded-store file) or that answers and may lose
    /// commits; a store that does not answer is retried by [`run`](Self::run).
    pub async fn build(config: Config, listeners: Listeners) -> Result<App, AppError> {
        for warning in config.warnings() {
            tracing::warn!("{warning}");
        }
        // The file's `telemetry` with the standard `OTEL_*` variables over it.
        let traces = crate::telemetry::Settings::resolve(&config.telemetry, &|name| {
            std::env::var(name).ok()
        })
        .map_err(AppError::Telemetry)?;
        let config = Arc::new(config);
        let (store, postgres) = open(&config)?;
        let prepared = match prepare_store(store.as_ref()).await {
            Ok(()) => {
                tracing::info!("migrations applied");
                true
            }
            Err(e @ StoreError::NotDurable(_)) => return Err(e.into()),
            Err(e) => {
                tracing::warn!(error = %e, "cannot check the store or apply migrations yet; serving and retrying in the background");
                false
            }
        };
        // Starts the store's background work too (the wake-up listener).
        let gateway = Arc::new(
            Gateway::with_traces(Arc::clone(&config), Arc::clone(&store), traces.as_ref())
                .map_err(AppError::Telemetry)?,
        );
        if prepared {
            gateway.readiness().store_ready();
        }
        Ok(App {
            config,
            store,
            postgres,
            gateway,
            listeners,
            prepared,
            reload_from: None,
        })
    }

    /// Reloads the configuration from `path` on every SIGHUP while running.
    pub fn reload_on_sighup(mut self, path: PathBuf) -> App {
        self.reload_from = Some(path);
        self
    }

    /// The address proxied traffic is served on.
    pub fn local_addr(&self) -> SocketAddr {
        self.listeners
            .main
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// The admin plane's address, when it has one.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.listeners
            .admin
            .as_ref()
            .map(|l| l.local_addr().expect("a bound listener has an address"))
    }

    pub fn gateway(&self) -> &Arc<Gateway> {
        &self.gateway
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The PostgreSQL store, when that is the configured one (its pool, for operators' tools
    /// and tests).
    pub fn postgres(&self) -> Option<&Arc<PgStore>> {
        self.postgres.as_ref()
    }

    pub fn config(&self) -> &Arc<Config> {
        &self.config
    }

    /// Whether the store answered, kept its commits and was migrated during `build`.
    pub fn is_prepared(&self) -> bool {
        self.prepared
    }

    /// Serves until `shutdown` resolves (then drains for `server.shutdown_grace`), or until a
    /// store that was down at `build` is found to lose commits (then returns that error).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), AppError> {
        let App {
            config,
            store,
            gateway,
            listeners,
            prepared,
            reload_from,
            ..
        } = self;
        let (stop_tx, stop_rx) = watch::channel(false);
        let (refused_tx, refused_rx) = oneshot::channel::<StoreError>();
        if !prepared {
            tokio::spawn(prepare_until_done(
                Arc::clone(&store),
                Arc::clone(&gateway),
                refused_tx,
                stop_rx.clone(),
            ));
        } else {
            tokio::spawn(online_until_done(Arc::clone(&store), stop_rx.clone()));
        }
        if let Some(admin) = listeners.admin {
            tracing::info!(listen = %admin.local_addr()?, "admin API serving");
            let mut rx = stop_rx.clone();
            tokio::spawn(crate::admin::run(admin, Arc::clone(&gateway), async move {
                let _ = rx.wait_for(|s| *s).await;
            }));
        }
        tokio::spawn(gc_loop(
            Arc::clone(&store),
            config.gc.clone(),
            stop_rx.clone(),
            Arc::clone(&gateway.metrics),
        ));
        if let Some(path) = reload_from {
            tokio::spawn(reload_on_sighup(path, Arc::clone(&gateway), stop_rx));
        }
        let refused = Arc::new(std::sync::Mutex::new(None));
        let stop = {
            let refused = Arc::clone(&refused);
            let gateway = Arc::clone(&gateway);
            async move {
                tokio::select! {
                    () = shutdown => {}
                    // Only sent on a refusal; a sender dropped after success disables this
                    // arm. A database that may lose commits is left at once, without a drain.
                    Ok(e) = refused_rx => {
                        gateway.readiness().start_draining();
                        *refused.lock().expect("refusal lock") = Some(e);
                    }
                }
            }
        };
        let served = serve(listeners.main, Arc::clone(&gateway), &config.server, stop).await;
        let _ = stop_tx.send(true);
        if let Some(telemetry) = gateway.telemetry().cloned() {
            // The spans of the last requests, bounded: a collector that does not answer
            // holds the exit up by at most this long.
            let bound = config
                .telemetry
                .timeout
                .min(std::time::Duration::from_secs(5));
            let _ = tokio::task::spawn_blocking(move || telemetry.shutdown(bound)).await;
        }
        if let Some(e) = refused.lock().expect("refusal lock").take() {
            return Err(e.into());
        }
        served.map_err(AppError::Serve)
    }
}

/// Serves `listener` on this runtime and, with `server.runtime: thread_per_core`, on
/// `worker_threads - 1` more threads of their own (`ServingThread`), until `stop` resolves;
/// returns once every thread has drained.
async fn serve(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    cfg: &crate::config::ServerConfig,
    stop: impl Future<Output = ()>,
) -> Result<(), String> {
    let slots = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections));
    let extra = match cfg.runtime {
        RuntimeLayout::ThreadPerCore => cfg.worker_threads.saturating_sub(1),
        RuntimeLayout::WorkStealing => 0,
    };
    if extra == 0 {
        return crate::server::run(listener, gateway, cfg.clone(), slots, None, stop).await;
    }
    let cannot = |e: std::io::Error| format!("cannot start the serving threads: {e}");
    let listener = listener.into_std().map_err(cannot)?;
    let stop_all = Arc::new(watch::channel(false).0);
    let mut places = crate::server::Balance::places(extra + 1).into_iter();
    let own_place = places.next().expect("one place per thread");
    let mut threads = Vec::with_capacity(extra);
    for (index, place) in (1..=extra).zip(places) {
        let thread = listener.try_clone().and_then(|dup| {
            crate::server::ServingThread::start(
                index,
                dup,
                Arc::clone(&gateway),
                cfg.clone(),
                Arc::clone(&slots),
                place,
                stop_all.subscribe(),
            )
        });
        match thread {
            Ok(thread) => threads.push(thread),
            Err(e) => {
                let _ = stop_all.send(true);
                for thread in threads {
                    thread.finish().await;
                }
                return Err(cannot(e));
            }
        }
    }
    let served = match TcpListener::from_std(listener) {
        Ok(listener) => {
            let stop_all = Arc::clone(&stop_all);
            let stop = async move {
                stop.await;
                let _ = stop_all.send(true);
            };
            crate::server::run(listener, gateway, cfg.clone(), slots, Some(own_place), stop).await
        }
        Err(e) => Err(cannot(e)),
    };
    // Also when this thread's listener failed before its stop came.
    let _ = stop_all.send(true);
    let mut result = served;
    for thread in &mut threads {
        let theirs = thread.served().await;
        result = result.and(theirs);
    }
    for thread in threads {
        thread.finish().await;
    }
    result
}

/// The store as the gateway uses it, and the same store when it is PostgreSQL.
type Opened = (Arc<dyn Store>, Option<Arc<PgStore>>);

/// Opens the configured store. Postgres connects lazily (this succeeds with it down); the
/// embedded store opens its file and takes its one-instance lock now.
pub(crate) fn open(config: &Config) -> Result<Opened, AppError> {
    match &config.store {
        StoreConfig::Postgres(pg) => {
            let pg = Arc::new(PgStore::new(pg)?);
            Ok((Arc::clone(&pg) as Arc<dyn Store>, Some(pg)))
        }
        #[cfg(feature = "sqlite")]
        StoreConfig::Sqlite(sq) => {
            Ok((Arc::new(crate::store::sqlite::SqliteStore::open(sq)?), None))
        }
        #[cfg(not(feature = "sqlite"))]
        StoreConfig::Sqlite(_) => Err(AppError::NoEmbeddedStore),
    }
}

/// What the gateway needs of the store before keyed requests can be trusted to it: that it
/// keeps its commits (checked first, so a refused database is left untouched), and the
/// migrations.
async fn prepare_store(store: &dyn Store) -> Result<(), StoreError> {
    store.durability().await?;
    if let Err(e) = store.migrate().await {
        // Not an outage to wait out quietly: the operator has to act (a long transaction
        // holds a lock, a migration fails), so every retry says why at error level. A role
        // that may not migrate is said once: nothing changes until an owner migrates, and
        // PostgreSQL's own log has each refused statement.
        static SAID: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());
        match &e {
            StoreError::Privilege(why) => {
                let mut said = SAID.lock().expect("the privilege error said");
                if *said == *why {
                    tracing::debug!(error = %e, "the migrations failed again");
                } else {
                    tracing::error!(error = %e, "the migrations failed; trying again");
                    why.clone_into(&mut said);
                }
            }
            _ => tracing::error!(error = %e, "the migrations failed; trying again"),
        }
        return Err(e);
    }
    Ok(())
}

/// Retries [`prepare_store`] with backoff (100 ms doubling to 5 s) until it succeeds (then
/// the gateway's store counts as ready); a store found not to keep its commits is sent on
/// `refused` (which stops [`App::run`]) instead.
async fn prepare_until_done(
    store: Arc<dyn Store>,
    gateway: Arc<Gateway>,
    refused: oneshot::Sender<StoreError>,
    mut stop: watch::Receiver<bool>,
) {
    let mut pause = Duration::from_millis(100);
    loop {
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        match prepare_store(store.as_ref()).await {
            Ok(()) => {
                tracing::info!("migrations applied; the store is ready");
                gateway.readiness().store_ready();
                online_until_done(store, stop).await;
                return;
            }
            Err(e @ StoreError::NotDurable(_)) => {
                tracing::error!(error = %e, "refusing to serve on this database; shutting down");
                let _ = refused.send(e);
                return;
            }
            Err(e) => tracing::debug!(error = %e, "store still not ready"),
        }
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

/// The migrations' online work (indexes built concurrently, backfills), while the gateway
/// serves; retried with backoff (1 s doubling to 1 min) until done or shutdown.
async fn online_until_done(store: Arc<dyn Store>, mut stop: watch::Receiver<bool>) {
    let mut pause = Duration::from_secs(1);
    loop {
        let run = tokio::select! {
            run = store.migrate_online() => run,
            _ = stop.wait_for(|s| *s) => return,
        };
        match run {
            Ok(run) => {
                if run.indexes_built > 0 || run.rows_filled > 0 {
                    tracing::info!(
                        indexes_built = run.indexes_built,
                        rows_filled = run.rows_filled,
                        "the migrations' online work is done"
                    );
                }
                return;
            }
            Err(e) => {
                tracing::error!(error = %e, "the migrations' online work failed; trying again")
            }
        }
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        pause = (pause * 2).min(Duration::from_secs(60));
    }
}

/// Collects expired rows every `interval` (the first time one interval after start) until
/// shutdown; errors are logged and retried at
/// the next tick.
/// Each collection is counted in `idemgate_gc_runs_total{result}` and its rows in
/// `idemgate_gc_rows_total`.
async fn gc_loop(
    store: Arc<dyn Store>,
    cfg: GcConfig,
    mut stop: watch::Receiver<bool>,
    metrics: Arc<crate::metrics::Metrics>,
) {
    // The first collection one interval after start, not at once: a fleet restarted
    // together does not all reach for the lock in the same second.
    let mut tick =
        tokio::time::interval_at(tokio::time::Instant::now() + cfg.interval, cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let run = store.gc(cfg.batch_size).await;
        metrics.collected(match &run {
            Ok(r) if r.ran => Ok(Some(r.deleted)),
            Ok(_) => Ok(None),
            Err(_) => Err(()),
        });
        match run {
            Ok(run) if run.deleted > 0 => {
                tracing::info!(deleted = run.deleted, "expired keys collected")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "collecting expired keys failed"),
        }
    }
}

/// On every SIGHUP: load and validate the file again; swap it in for new requests, or keep
/// the old configuration and say why.
async fn reload_on_sighup(path: PathBuf, gateway: Arc<Gateway>, mut stop: watch::Receiver<bool>) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot listen for SIGHUP; reload needs a restart");
        return;
    };
    loop {
        tokio::select! {
            got = hup.recv() => if got.is_none() { return },
            _ = stop.wait_for(|s| *s) => return,
        }
        match Config::load(&path) {
            Err(e) => {
                gateway.metrics().reloaded(false);
                tracing::error!(error = %e, "reload refused; the old configuration stays in force")
            }
            Ok(config) => {
                let routes = config.routes.len();
                match gateway.reload_certificate() {
                    None => {}
                    Some(Ok(())) => tracing::info!(
                        "the listener's certificate was read again; new connections use it"
                    ),
                    Some(Err(why)) => {
                        tracing::error!(error = %why, "the listener's certificate could not be read again; the one in place stays")
                    }
                }
                let reloaded = gateway.reload(config);
                gateway.metrics().reloaded(reloaded.is_ok());
                match reloaded {
                    Err(why) => {
                        tracing::error!(error = %why, "reload refused; the old configuration stays in force")
                    }
                    Ok(ignored) if ignored.is_empty() => {
                        tracing::info!(routes, "configuration reloaded")
                    }
                    Ok(ignored) => {
                        tracing::warn!(routes, needs_restart = ?ignored, "configuration reloaded; these changes apply after a restart")
                    }
                }
            }
        }
    }
}
