package org.apache.spark.kafka010;

/** Drop-in for Spark's KafkaTokenUtil object: no delegation tokens, so nothing matches or needs renewal. */
public final class KafkaTokenUtil$ {
  public static final KafkaTokenUtil$ MODULE$ = new KafkaTokenUtil$();

  private KafkaTokenUtil$() {}

  public scala.Option<Object> findMatchingTokenClusterConfig(
      org.apache.spark.SparkConf sparkConf, String bootStrapServers) {
    return scala.Option.empty();
  }

  public boolean needTokenUpdate(java.util.Map<String, Object> params, scala.Option<?> clusterConfig) {
    return false;
  }
}
