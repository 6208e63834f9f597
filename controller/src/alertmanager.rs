//! Alerts delivered to Alertmanager (issue 35, decision 0053), on the
//! controller's clock: soon after an evaluation raised or resolved alerts,
//! every 5 s while a change waits (an Alertmanager is down), and every
//! `alertmanager_resend_secs` with every open alert. The observability
//! context keeps what waits (its `alertmanager_pending`); this is its HTTP
//! client ([`mesh_observability::AlertPoster`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mesh_observability::AlertPoster;
use tokio_util::sync::CancellationToken;

use crate::contexts::Contexts;
use crate::metrics::Metrics;

/// How long one post may take, and how soon a waiting change is retried.
const POST_TIMEOUT: Duration = Duration::from_secs(10);
const RETRY: Duration = Duration::from_secs(5);

/// reqwest, rustls, trusting the CA bundle of `ca_file` (https
/// Alertmanagers); no redirects.
pub struct HttpPoster {
    client: reqwest::Client,
}

impl HttpPoster {
    pub fn new(ca_file: &std::path::Path) -> Result<HttpPoster, reqwest::Error> {
        let mut builder = reqwest::Client::builder()
            .timeout(POST_TIMEOUT)
            .connect_timeout(POST_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .tls_built_in_root_certs(false)
            .use_rustls_tls();
        if let Ok(pem) = std::fs::read(ca_file)
            && let Ok(certs) = reqwest::Certificate::from_pem_bundle(&pem)
        {
            for c in certs {
                builder = builder.add_root_certificate(c);
            }
        }
        Ok(HttpPoster {
            client: builder.build()?,
        })
    }
}

impl AlertPoster for HttpPoster {
    fn post<'a>(
        &'a self,
        url: &'a str,
        body: Vec<u8>,
    ) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send + 'a>> {
        Box::pin(async move {
            let r = self
                .client
                .post(url)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            if r.status().is_success() {
                Ok(())
            } else {
                Err(format!("answered {}", r.status()))
            }
        })
    }
}

/// Deliver until `shutdown` (without `alertmanager_urls`, only wait for it:
/// a task of the controller that ends stops the controller).
pub async fn run(
    contexts: Arc<Contexts>,
    poster: HttpPoster,
    metrics: Metrics,
    shutdown: CancellationToken,
) {
    let settings = contexts.observability.settings().clone();
    if settings.alertmanager_urls.is_empty() {
        shutdown.cancelled().await;
        return;
    }
    tracing::info!(urls = ?settings.alertmanager_urls, "delivering alerts to Alertmanager");
    let resend_every = settings.alertmanager_resend;
    let mut last_resend: Option<Instant> = None;
    loop {
        let resend = last_resend.is_none_or(|t| t.elapsed() >= resend_every);
        let waiting = match contexts.observability.deliver_alerts(&poster, resend).await {
            Ok(d) => {
                metrics.alertmanager_sent.inc_by(d.sent);
                metrics.alertmanager_failed.inc_by(d.failed);
                metrics.alertmanager_pending.set(d.pending);
                if let Some(e) = &d.error {
                    tracing::warn!(error = %e, pending = d.pending, "an Alertmanager refused alerts; kept, sent again");
                }
                if resend && d.failed == 0 {
                    last_resend = Some(Instant::now());
                }
                d.pending > 0 || d.failed > 0
            }
            Err(e) => {
                tracing::warn!(error = %e, "delivering alerts failed; retrying");
                true
            }
        };
        let until_resend = last_resend
            .map(|t| resend_every.saturating_sub(t.elapsed()))
            .unwrap_or(RETRY);
        let wait = if waiting {
            until_resend.min(RETRY)
        } else {
            until_resend
        };
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = contexts.observability.alerts_changed() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
