package kvledger.examples.violations;

import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.OutputStreamWriter;
import java.io.PrintWriter;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.Collection;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.TreeMap;
import org.apache.avro.Schema;
import org.apache.avro.generic.GenericRecord;
import org.apache.kafka.clients.consumer.CloseOptions;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRebalanceListener;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.KafkaException;
import org.apache.kafka.common.PartitionInfo;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.errors.TimeoutException;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;

/**
 * Prints every violation of {@code <prefix>.violations} once, as JSON lines in the shape of
 * {@code kvledger violations --format json}, then a summary line, and exits when the topic has
 * been idle for the idle timeout.
 *
 * <p>Exit status as the project's CLI: 0 no violations, 1 violations found, 2 unusable input or
 * unreachable broker (one line on stderr).
 */
public final class ViolationsConsumer {
    static final String NAME = "kvledger-violations";
    private static final Duration BROKER_TIMEOUT = Duration.ofSeconds(5);
    private static final Duration JOIN_TIMEOUT = Duration.ofSeconds(30);
    private static final Duration MAX_POLL = Duration.ofMillis(500);

    private final Options options;
    private final ViolationDecoder decoder;
    private final Schema schema;
    private final PrintWriter out =
            new PrintWriter(new OutputStreamWriter(new FileOutputStream(FileDescriptor.out), StandardCharsets.UTF_8));

    // What the read saw, for the summary line.
    private final Set<ByteBuffer> seenIds = new HashSet<>();
    private final Map<String, Integer> kinds = new TreeMap<>();
    private final Set<String> engines = new HashSet<>();
    private long records;
    private long duplicates;
    private long undecodable;

    private ViolationsConsumer(Options options) {
        this.options = options;
        SchemaFiles schemas = SchemaFiles.load(options.schemaDir(), options.writerSchemas());
        this.schema = schemas.reader();
        ConfluentRegistry registry =
                options.registry() == null ? null : new ConfluentRegistry(options.registry(), schema);
        this.decoder = new ViolationDecoder(schema, schemas.writers(), registry);
    }

    public static void main(String[] args) {
        try {
            Options options = Options.parse(args);
            if (options == null) {
                System.out.println(Options.USAGE);
                return;
            }
            System.exit(new ViolationsConsumer(options).run());
        } catch (FatalError e) {
            System.err.println(NAME + ": error: " + e.getMessage());
            System.exit(2);
        }
    }

    private int run() {
        String topic = options.topicPrefix() + ".violations";
        KafkaConsumer<byte[], byte[]> consumer;
        try {
            consumer = new KafkaConsumer<>(consumerConfig(), new ByteArrayDeserializer(), new ByteArrayDeserializer());
        } catch (KafkaException e) {
            throw new FatalError(
                    "cannot use bootstrap servers " + options.bootstrap() + ": " + FatalError.rootCause(e));
        }
        try {
            requireTopic(consumer, topic);
            consume(consumer, topic);
        } catch (KafkaException e) {
            throw new FatalError(
                    "reading " + topic + " from " + options.bootstrap() + " failed: " + FatalError.rootCause(e));
        } finally {
            consumer.close(CloseOptions.timeout(BROKER_TIMEOUT));
        }
        out.println(Json.write(summary()));
        out.flush();
        return kinds.isEmpty() ? 0 : 1;
    }

    private Properties consumerConfig() {
        Properties config = new Properties();
        config.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, options.bootstrap());
        config.put(ConsumerConfig.GROUP_ID_CONFIG, options.group());
        config.put(ConsumerConfig.CLIENT_ID_CONFIG, NAME);
        // A fresh group has no offsets: read the whole topic, and leave nothing committed behind.
        config.put(ConsumerConfig.AUTO_OFFSET_RESET_CONFIG, "earliest");
        config.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
        // A reader must not create the topic it looks for.
        config.put(ConsumerConfig.ALLOW_AUTO_CREATE_TOPICS_CONFIG, "false");
        return config;
    }

    private void requireTopic(KafkaConsumer<byte[], byte[]> consumer, String topic) {
        Map<String, List<PartitionInfo>> topics;
        try {
            topics = consumer.listTopics(BROKER_TIMEOUT);
        } catch (TimeoutException e) {
            throw new FatalError("no Kafka broker answers at " + options.bootstrap());
        }
        if (!topics.containsKey(topic)) {
            throw new FatalError(
                    "topic " + topic + " does not exist (is a worker running against " + options.bootstrap() + "?)");
        }
    }

    private void consume(KafkaConsumer<byte[], byte[]> consumer, String topic) {
        Assignment assignment = new Assignment();
        consumer.subscribe(List.of(topic), assignment);
        long idle = options.idleTimeout().toNanos();
        long joinDeadline = System.nanoTime() + JOIN_TIMEOUT.toNanos();
        long lastNew = 0;
        boolean counting = false; // the idle clock starts once the group has assigned the partitions
        Duration poll = options.idleTimeout().compareTo(MAX_POLL) < 0 ? options.idleTimeout() : MAX_POLL;
        while (true) {
            var batch = consumer.poll(poll);
            long now = System.nanoTime();
            if (!counting && assignment.assigned) {
                counting = true;
                lastNew = now;
            }
            if (!counting && now > joinDeadline) {
                throw new FatalError(
                        "no partitions of " + topic + " assigned within " + JOIN_TIMEOUT.toSeconds() + "s");
            }
            for (ConsumerRecord<byte[], byte[]> record : batch) {
                lastNew = now;
                handle(record);
            }
            if (counting && now - lastNew >= idle) {
                return;
            }
        }
    }

    /** Each violation id (the record key) once: a repeated id is a worker's re-send after a restart. */
    private void handle(ConsumerRecord<byte[], byte[]> record) {
        records++;
        ByteBuffer id = ByteBuffer.wrap(record.key() == null ? new byte[0] : record.key());
        if (seenIds.contains(id)) {
            duplicates++;
            return;
        }
        GenericRecord violation;
        try {
            violation = decoder.decode(record.value());
        } catch (UndecodableRecordException e) {
            undecodable++;
            System.err.printf("%s: skipped %s/%d@%d: %s%n", NAME, record.topic(), record.partition(), record.offset(),
                    e.getMessage());
            return;
        }
        seenIds.add(id);
        kinds.merge(violation.get("kind").toString(), 1, Integer::sum);
        engines.add(violation.get("engine_id").toString());
        out.println(Json.write(asLine(violation)));
        out.flush();
    }

    /** {"type": "violation"} and the record's fields, in the schema's order. */
    private Map<String, Object> asLine(GenericRecord violation) {
        Map<String, Object> line = new LinkedHashMap<>();
        line.put("type", "violation");
        for (Schema.Field field : schema.getFields()) {
            Object value = violation.get(field.pos());
            line.put(field.name(), value instanceof CharSequence text ? text.toString() : value);
        }
        return line;
    }

    private Map<String, Object> summary() {
        Map<String, Object> summary = new LinkedHashMap<>();
        summary.put("type", "summary");
        summary.put("violations", kinds);
        summary.put("engines", engines.size());
        summary.put("records", records);
        summary.put("duplicates_dropped", duplicates);
        summary.put("undecodable", undecodable);
        return summary;
    }

    private static final class Assignment implements ConsumerRebalanceListener {
        boolean assigned;

        @Override
        public void onPartitionsAssigned(Collection<TopicPartition> partitions) {
            assigned = true;
        }

        @Override
        public void onPartitionsRevoked(Collection<TopicPartition> partitions) {}
    }
}
