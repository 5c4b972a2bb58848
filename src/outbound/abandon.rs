//! What an exchange abandoned before its response head stops: the task carrying its request.

/// Aborts a task that carries a request (an HTTP/1.1 connection, an HTTP/2 request body) when
/// dropped before `answered`: the exchange was abandoned before its response head.
pub struct AbortUnlessAnswered(pub Option<tokio::task::AbortHandle>);

impl AbortUnlessAnswered {
    pub fn answered(mut self) {
        self.0 = None;
    }
}

impl Drop for AbortUnlessAnswered {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}
