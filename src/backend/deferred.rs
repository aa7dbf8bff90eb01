//! A backend that is connected in the background: the service starts serving at once and
//! answers by its failure policy until the connection is made, instead of refusing to start
//! (or crash-looping) while Redis is not reachable yet.

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::Backend;
use crate::decision::{BackendError, Charging, Hit, Outcome};

const FIRST_RETRY: Duration = Duration::from_millis(100);
const MAX_RETRY: Duration = Duration::from_secs(5);

pub struct Deferred<B> {
    inner: Arc<OnceLock<B>>,
}

impl<B: Backend> Deferred<B> {
    /// Call `connect` until it succeeds, backing off between attempts.
    pub fn connect<F, Fut>(mut connect: F) -> Deferred<B>
    where
        F: FnMut() -> Fut + Send + 'static,
        Fut: Future<Output = Result<B, BackendError>> + Send,
    {
        let inner = Arc::new(OnceLock::new());
        let cell = inner.clone();
        tokio::spawn(async move {
            let mut wait = FIRST_RETRY;
            loop {
                match connect().await {
                    Ok(backend) => {
                        tracing::info!("backend connected");
                        let _ = cell.set(backend);
                        return;
                    }
                    Err(error) => {
                        tracing::warn!(%error, retry_in = ?wait, "cannot connect to the backend");
                        tokio::time::sleep(wait).await;
                        wait = (wait * 2).min(MAX_RETRY);
                    }
                }
            }
        });
        Deferred { inner }
    }
}

impl<B: Backend> Backend for Deferred<B> {
    async fn evaluate(
        &self,
        hits: &[Hit],
        charging: Charging,
    ) -> Result<Vec<Outcome>, BackendError> {
        match self.inner.get() {
            Some(backend) => backend.evaluate(hits, charging).await,
            None => Err(BackendError::Unavailable("not connected yet".into())),
        }
    }

    async fn ready(&self) -> bool {
        match self.inner.get() {
            Some(backend) => backend.ready().await,
            None => false,
        }
    }

    fn switches(&self) -> u64 {
        self.inner.get().map_or(0, Backend::switches)
    }
}
