//! The integration tests: one binary, real Postgres, real upstreams, real concurrency.

mod cli;
mod config_files;
mod flow;
mod hostile_clients;
mod status_table;
mod operator_tools;
mod store_outage;
mod support;
mod upstream_faults;
