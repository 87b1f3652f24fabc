//! The lab's naive legacy ledger (docs/lab.md): `POST /webhooks/payments` appends a ledger
//! row without any uniqueness and updates the account's balance by reading it, doing some
//! work (an ORM round trip, simulated by a short sleep), then writing it back. So it doubles
//! rows on redelivery and loses updates under concurrency, exactly as the lab measured. Its
//! state is in memory, for the checks (`lab.rs`) to inspect.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

/// The path of the ledger's webhook endpoint.
pub const WEBHOOK_PATH: &str = "/webhooks/payments";
/// The amount every lab delivery carries.
pub const AMOUNT: i64 = 100;

/// One ledger row.
#[derive(Debug, Clone)]
pub struct Row {
    pub id: u64,
    pub event_id: String,
    pub payment_id: String,
    pub account_id: String,
    pub amount: i64,
}

#[derive(Default)]
struct LedgerState {
    rows: Vec<Row>,
    balances: HashMap<String, i64>,
}

/// The naive legacy ledger, in memory.
pub struct Ledger {
    state: Mutex<LedgerState>,
    next_id: AtomicU64,
    /// Requests that reached the handler (executions).
    received: AtomicUsize,
    /// Pause between reading and writing the balance, in milliseconds.
    work_ms: AtomicU64,
}

impl Ledger {
    pub fn new(work: Duration) -> Arc<Ledger> {
        Arc::new(Ledger {
            state: Mutex::default(),
            next_id: AtomicU64::new(1),
            received: AtomicUsize::new(0),
            work_ms: AtomicU64::new(work.as_millis() as u64),
        })
    }

    /// Serves the ledger on `listener` until the task is aborted.
    pub fn serve(self: &Arc<Self>, listener: TcpListener) -> tokio::task::JoinHandle<()> {
        let ledger = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let ledger = Arc::clone(&ledger);
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let ledger = Arc::clone(&ledger);
                        async move { Ok::<_, Infallible>(ledger.handle(req).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        })
    }

    /// Binds 127.0.0.1:0 and serves; returns the address.
    pub async fn start(
        self: &Arc<Self>,
    ) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        Ok((addr, self.serve(listener)))
    }

    pub fn set_work(&self, work: Duration) {
        self.work_ms
            .store(work.as_millis() as u64, Ordering::SeqCst);
    }

    pub fn received(&self) -> usize {
        self.received.load(Ordering::SeqCst)
    }

    /// Ledger rows for a payment.
    pub fn rows_for_payment(&self, payment_id: &str) -> usize {
        let st = self.state.lock().expect("ledger lock");
        st.rows
            .iter()
            .filter(|r| r.payment_id == payment_id)
            .count()
    }

    /// Ledger rows and balance of an account.
    pub fn account(&self, account_id: &str) -> (usize, i64) {
        let st = self.state.lock().expect("ledger lock");
        (
            st.rows
                .iter()
                .filter(|r| r.account_id == account_id)
                .count(),
            st.balances.get(account_id).copied().unwrap_or(0),
        )
    }

    async fn handle(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        if req.method() != Method::POST || req.uri().path() != WEBHOOK_PATH {
            return reply(
                StatusCode::NOT_FOUND,
                serde_json::json!({"error": "not found"}),
            );
        }
        let Ok(body) = req.into_body().collect().await else {
            return reply(
                StatusCode::BAD_REQUEST,
                serde_json::json!({"error": "bad body"}),
            );
        };
        let Ok(event) = serde_json::from_slice::<serde_json::Value>(&body.to_bytes()) else {
            return reply(
                StatusCode::BAD_REQUEST,
                serde_json::json!({"error": "not JSON"}),
            );
        };
        self.received.fetch_add(1, Ordering::SeqCst);
        let text = |f: &str| event[f].as_str().unwrap_or_default().to_string();
        let (event_id, payment_id, account_id) =
            (text("event_id"), text("payment_id"), text("account_id"));
        let amount = event["amount"].as_i64().unwrap_or(0);
        // "We answer 200 after commit, so each event arrives once": no uniqueness at all.
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let read = {
            let mut st = self.state.lock().expect("ledger lock");
            st.rows.push(Row {
                id,
                event_id: event_id.clone(),
                payment_id,
                account_id: account_id.clone(),
                amount,
            });
            st.balances.get(&account_id).copied().unwrap_or(0)
        };
        // account.balance = account.balance + amount, the ORM way: read, work, write.
        let work = self.work_ms.load(Ordering::SeqCst);
        if work > 0 {
            tokio::time::sleep(Duration::from_millis(work)).await;
        }
        let balance = read + amount;
        self.state
            .lock()
            .expect("ledger lock")
            .balances
            .insert(account_id, balance);
        reply(
            StatusCode::OK,
            serde_json::json!({"received": event_id, "ledger_row": id, "balance": balance}),
        )
    }
}

fn reply(status: StatusCode, body: serde_json::Value) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}
