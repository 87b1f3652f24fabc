//! The integration tests: one binary, real Postgres, real upstreams, real concurrency.

mod async_commit;
mod cli;
mod config_files;
mod conformance;
mod crash_and_shutdown;
mod deploy;
mod dockerfile;
mod embedded_store;
mod flow;
mod health;
mod holes;
mod hostile_clients;
mod instances;
mod lab;
mod operations;
mod operator_tools;
mod replay_cache;
mod rollout;
mod serialize;
mod status_table;
mod store_claim;
mod store_outage;
mod support;
mod tls;
mod upstream_faults;
