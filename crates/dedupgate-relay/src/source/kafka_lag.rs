//! The consumer group's lag on a Kafka route's topic: the records past the group's committed
//! offsets, summed over partitions (a partition with no commit counts from its low
//! watermark). Read by a client of its own that does not join the group (OffsetFetch and
//! ListOffsets only), every [`LAG_EVERY`], off the async threads: librdkafka's calls block.

use std::time::Duration;

use dedupgate_consumers::kafka::rdkafka::config::ClientConfig;
use dedupgate_consumers::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use dedupgate_consumers::kafka::rdkafka::error::KafkaResult;
use dedupgate_consumers::kafka::rdkafka::{Offset, TopicPartitionList};

/// How often the lag is read: each read is a metadata, an offset-fetch and a watermark request
/// per partition.
pub(crate) const LAG_EVERY: Duration = Duration::from_secs(5);

/// How long one broker request of a lag read may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) struct LagReader {
    client: BaseConsumer,
    topic: String,
}

impl LagReader {
    pub(crate) fn new(bootstrap: &str, group: &str, topic: &str) -> KafkaResult<Self> {
        let client = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()?;
        Ok(Self {
            client,
            topic: topic.to_owned(),
        })
    }

    /// The group's lag now (blocking).
    pub(crate) fn read(&self) -> KafkaResult<u64> {
        let metadata = self
            .client
            .fetch_metadata(Some(&self.topic), REQUEST_TIMEOUT)?;
        let mut tpl = TopicPartitionList::new();
        for topic in metadata.topics() {
            for partition in topic.partitions() {
                tpl.add_partition(&self.topic, partition.id());
            }
        }
        let committed = self
            .client
            .committed_offsets(tpl.clone(), REQUEST_TIMEOUT)?;
        let mut lag = 0u64;
        for element in tpl.elements() {
            let (low, high) =
                self.client
                    .fetch_watermarks(&self.topic, element.partition(), REQUEST_TIMEOUT)?;
            let from = match committed
                .find_partition(&self.topic, element.partition())
                .map(|e| e.offset())
            {
                Some(Offset::Offset(o)) => o,
                _ => low,
            };
            lag += u64::try_from(high.saturating_sub(from)).unwrap_or(0);
        }
        Ok(lag)
    }
}
