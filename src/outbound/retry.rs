//! Which endpoint a request tries next: a request whose connection failed before anything was
//! sent is retried on an endpoint it has not tried yet, up to `MAX_RETRIES` times (SPEC section 1).

use std::net::SocketAddr;
use std::sync::Arc;

use super::cluster::{Cluster, EndpointState};
use super::lb;
use crate::catalog::Labels;
use crate::config::Locality;
use crate::http::answer::Reason;

pub const MAX_RETRIES: usize = 2;

/// The endpoints one request has tried, and why the last one failed.
pub struct Tries<'a> {
    cluster: &'a Cluster,
    subset: Option<&'a Labels>,
    locality: Option<&'a Locality>,
    tried: Vec<SocketAddr>,
    last: Reason,
}

impl<'a> Tries<'a> {
    pub fn new(
        cluster: &'a Cluster,
        subset: Option<&'a Labels>,
        locality: Option<&'a Locality>,
    ) -> Tries<'a> {
        Tries {
            cluster,
            subset,
            locality,
            tried: Vec::new(),
            last: Reason::UpstreamConnectFailure,
        }
    }

    /// The next endpoint to try. When there is none, the answer: the balancer's reason on the
    /// first try, the last failure's after that.
    pub fn next(&self) -> Result<Arc<EndpointState>, Reason> {
        match lb::pick(self.cluster, self.subset, self.locality, &self.tried, |n| {
            fastrand::usize(..n)
        }) {
            Ok(e) => Ok(e),
            Err(r) if self.tried.is_empty() => Err(r),
            Err(_) => Err(self.last),
        }
    }

    /// Records a failed connect to `ep` (it counts for outlier detection). False when the
    /// request has no retry left.
    pub fn failed(&mut self, ep: &EndpointState, reason: Reason) -> bool {
        self.cluster.record(ep, true);
        self.tried.push(ep.address);
        self.last = reason;
        self.tried.len() <= MAX_RETRIES
    }

    /// Records that `ep` is not worth trying for this request (a dial to it just failed for
    /// another request; outlier detection counted that one). False when no retry is left.
    pub fn skip(&mut self, ep: &EndpointState, reason: Reason) -> bool {
        self.tried.push(ep.address);
        self.last = reason;
        self.tried.len() <= MAX_RETRIES
    }

    pub fn last(&self) -> Reason {
        self.last
    }
}
